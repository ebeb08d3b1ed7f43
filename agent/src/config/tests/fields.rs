//! Every field, one by one: each is honoured, warned about or rejected, and the list of fields
//! is kube-proxy's.

use super::*;

// ------------------------------------------------------------------------------------------
// Every field, one by one.

/// Every field of `KubeProxyConfiguration`, as a path of camelCase keys. `CASES` must cover
/// each one, the model must have exactly these, and README.md must name each.
pub(super) const FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "featureGates",
    "clientConnection.kubeconfig",
    "clientConnection.acceptContentTypes",
    "clientConnection.contentType",
    "clientConnection.qps",
    "clientConnection.burst",
    "logging.format",
    "logging.flushFrequency",
    "logging.verbosity",
    "logging.vmodule",
    "logging.options.text.splitStream",
    "logging.options.text.infoBufferSize",
    "logging.options.json.splitStream",
    "logging.options.json.infoBufferSize",
    "hostnameOverride",
    "bindAddress",
    "healthzBindAddress",
    "metricsBindAddress",
    "bindAddressHardFail",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "mode",
    "iptables.masqueradeBit",
    "iptables.masqueradeAll",
    "iptables.localhostNodePorts",
    "iptables.syncPeriod",
    "iptables.minSyncPeriod",
    "ipvs.syncPeriod",
    "ipvs.minSyncPeriod",
    "ipvs.scheduler",
    "ipvs.excludeCIDRs",
    "ipvs.strictARP",
    "ipvs.tcpTimeout",
    "ipvs.tcpFinTimeout",
    "ipvs.udpTimeout",
    "nftables.masqueradeBit",
    "nftables.masqueradeAll",
    "nftables.syncPeriod",
    "nftables.minSyncPeriod",
    "winkernel.networkName",
    "winkernel.sourceVip",
    "winkernel.enableDSR",
    "winkernel.rootHnsEndpointName",
    "winkernel.forwardHealthCheckVip",
    "detectLocalMode",
    "detectLocal.bridgeInterface",
    "detectLocal.interfaceNamePrefix",
    "clusterCIDR",
    "nodePortAddresses",
    "oomScoreAdj",
    "conntrack.maxPerCore",
    "conntrack.min",
    "conntrack.tcpEstablishedTimeout",
    "conntrack.tcpCloseWaitTimeout",
    "conntrack.tcpBeLiberal",
    "conntrack.udpTimeout",
    "conntrack.udpStreamTimeout",
    "configSyncPeriod",
    "portRange",
    "windowsRunAsService",
];

pub(super) enum Expect {
    /// Resolves, and the value reached the settings.
    Honoured(fn(&Settings) -> bool),
    /// Resolves, with a warning that names the field and contains this text.
    Warned(&'static str),
    /// Fails, naming the field.
    Rejected,
}
use Expect::{Honoured, Rejected, Warned};

pub(super) struct Case {
    pub(super) field: &'static str,
    pub(super) yaml: &'static str,
    pub(super) expect: Expect,
}

pub(super) const fn case(field: &'static str, yaml: &'static str, expect: Expect) -> Case {
    Case {
        field,
        yaml,
        expect,
    }
}

#[rustfmt::skip]
pub(super) const CASES: &[Case] = &[
    case("apiVersion", "apiVersion: kubeproxy.config.k8s.io/v1alpha1", Honoured(|s| s.effective["apiVersion"] == API_VERSION)),
    case("apiVersion", "apiVersion: kubeproxy.config.k8s.io/v1beta1", Rejected),
    case("apiVersion", "apiVersion: componentconfig/v1alpha1", Rejected),
    case("kind", "kind: KubeProxyConfiguration", Honoured(|s| s.effective["kind"] == KIND)),
    case("kind", "kind: KubeletConfiguration", Rejected),
    case("featureGates", "featureGates: {SomeGate: true, Other: false}", Warned("Other=false, SomeGate=true")),
    case("featureGates", "featureGates: \"\"", Rejected),
    case("clientConnection.kubeconfig", "clientConnection: {kubeconfig: /k}", Honoured(|s| s.kubeconfig.as_deref() == Some("/k"))),
    case("clientConnection.acceptContentTypes", "clientConnection: {acceptContentTypes: application/json}", Honoured(|s| s.warnings.iter().all(|w| !w.field.starts_with("clientConnection")))),
    case("clientConnection.acceptContentTypes", "clientConnection: {acceptContentTypes: application/vnd.kubernetes.protobuf}", Warned("always accepts application/json")),
    case("clientConnection.contentType", "clientConnection: {contentType: application/cbor}", Warned("always sends application/json")),
    case("clientConnection.qps", "clientConnection: {qps: 20.5}", Honoured(|s| s.client.qps == 20.5)),
    case("clientConnection.burst", "clientConnection: {burst: 30}", Honoured(|s| s.client.burst == 30)),
    case("clientConnection.burst", "clientConnection: {burst: -1}", Rejected),
    case("logging.format", "logging: {format: json}", Honoured(|s| s.logging.format == LogFormat::Json)),
    case("logging.format", "logging: {format: xml}", Rejected),
    case("logging.flushFrequency", "logging: {flushFrequency: 10s}", Warned("10s")),
    case("logging.flushFrequency", "logging: {flushFrequency: 1000000000}", Warned("1s")),
    case("logging.flushFrequency", "logging: {flushFrequency: 5s}", Honoured(|s| s.warnings.iter().all(|w| !w.field.starts_with("logging")))),
    case("logging.flushFrequency", "logging: {flushFrequency: soon}", Rejected),
    case("logging.verbosity", "logging: {verbosity: 4}", Honoured(|s| s.logging.verbosity == 4)),
    case("logging.verbosity", "logging: {verbosity: 4294967295}", Rejected),
    case("logging.verbosity", "logging: {verbosity: -1}", Rejected),
    case("logging.vmodule", "logging: {vmodule: [{filePattern: proxier, verbosity: 4}]}", Warned("per-file verbosity")),
    case("logging.vmodule", "logging: {vmodule: [{filePattern: \"\", verbosity: 4}]}", Rejected),
    case("logging.vmodule", "logging: {vmodule: [{filePattern: \"a=b\", verbosity: 4}]}", Rejected),
    case("logging.vmodule", "logging: {format: json, vmodule: [{filePattern: a, verbosity: 4}]}", Rejected),
    case("logging.options.text.splitStream", "logging: {options: {text: {splitStream: true}}}", Rejected),
    case("logging.options.text.splitStream", "featureGates: {LoggingAlphaOptions: true}\nlogging: {options: {text: {splitStream: true}}}", Warned("standard error")),
    case("logging.options.text.infoBufferSize", "logging: {options: {text: {infoBufferSize: 1Ki}}}", Rejected),
    case("logging.options.text.infoBufferSize", "featureGates: {LoggingAlphaOptions: true}\nlogging: {options: {text: {infoBufferSize: 1Ki}}}", Warned("does not buffer")),
    case("logging.options.json.splitStream", "logging: {options: {json: {splitStream: true}}}", Rejected),
    case("logging.options.json.splitStream", "featureGates: {LoggingAlphaOptions: true}\nlogging: {options: {json: {splitStream: true}}}", Warned("standard error")),
    case("logging.options.json.infoBufferSize", "logging: {options: {json: {infoBufferSize: \"1M\"}}}", Rejected),
    case("logging.options.json.infoBufferSize", "featureGates: {LoggingAlphaOptions: true}\nlogging: {options: {json: {infoBufferSize: 512}}}", Warned("does not buffer")),
    case("hostnameOverride", "hostnameOverride: \" Node-A \"", Honoured(|s| s.node_name == "node-a" && s.build.node_name == "node-a")),
    case("hostnameOverride", "hostnameOverride: \"  \"", Rejected),
    case("bindAddress", "bindAddress: 10.1.2.3", Honoured(|s| s.bind_address == IpAddr::from([10, 1, 2, 3]))),
    case("bindAddress", "bindAddress: \"::\"", Honoured(|s| { s.healthz_bind_address == "[::]:10256" && s.metrics_bind_address == "[::1]:10249" })),
    case("bindAddress", "bindAddress: node-1", Rejected),
    case("healthzBindAddress", "healthzBindAddress: 127.0.0.2", Honoured(|s| s.healthz_bind_address == "127.0.0.2:10256")),
    case("healthzBindAddress", "healthzBindAddress: \"[::1]:1234\"", Honoured(|s| s.healthz_bind_address == "[::1]:1234")),
    case("healthzBindAddress", "healthzBindAddress: 0.0.0.0:0", Rejected),
    case("healthzBindAddress", "healthzBindAddress: localhost:10256", Rejected),
    case("healthzBindAddress", "healthzBindAddress: 0.0.0.0:65536", Rejected),
    case("metricsBindAddress", "metricsBindAddress: 0.0.0.0:9999", Honoured(|s| s.metrics_bind_address == "0.0.0.0:9999")),
    case("metricsBindAddress", "metricsBindAddress: \":10249\"", Rejected),
    case("metricsBindAddress", "metricsBindAddress: \"[::1]\"", Rejected),
    case("bindAddressHardFail", "bindAddressHardFail: true", Honoured(|s| s.bind_address_hard_fail)),
    case("enableProfiling", "enableProfiling: true", Warned("pprof")),
    case("showHiddenMetricsForVersion", "showHiddenMetricsForVersion: \"1.32\"", Warned("hidden")),
    case("showHiddenMetricsForVersion", "showHiddenMetricsForVersion: v1.32", Rejected),
    case("mode", "mode: iptables", Honoured(|s| s.mode == ProxyMode::Iptables && s.effective["mode"] == "iptables")),
    case("mode", "mode: \"\"", Honoured(|s| s.mode == ProxyMode::Nftables && s.effective["mode"] == "nftables")),
    case("mode", "mode: ipvs", Rejected),
    case("mode", "mode: kernelspace", Rejected),
    case("iptables.masqueradeBit", "mode: iptables\niptables: {masqueradeBit: 5}", Honoured(|s| s.build.masquerade_bit == 5)),
    case("iptables.masqueradeBit", "iptables: {masqueradeBit: 5}", Warned("unused in nftables mode")),
    // kube-proxy checks the iptables bit in every mode.
    case("iptables.masqueradeBit", "mode: nftables\niptables: {masqueradeBit: 32}", Rejected),
    case("iptables.masqueradeAll", "mode: iptables\niptables: {masqueradeAll: true}", Honoured(|s| s.build.masquerade_all)),
    case("iptables.masqueradeAll", "mode: nftables\niptables: {masqueradeAll: true}", Warned("unused in nftables mode")),
    case("iptables.localhostNodePorts", "mode: iptables\niptables: {localhostNodePorts: false}", Honoured(|s| !s.iptables.localhost_node_ports)),
    case("iptables.localhostNodePorts", "mode: nftables\niptables: {localhostNodePorts: false}", Warned("unused in nftables mode")),
    case("iptables.syncPeriod", "mode: iptables\niptables: {syncPeriod: 10s}", Honoured(|s| s.sync_period == Duration::from_secs(10))),
    case("iptables.syncPeriod", "mode: iptables\niptables: {syncPeriod: -10s}", Rejected),
    case("iptables.syncPeriod", "mode: nftables\niptables: {syncPeriod: 10s}", Warned("unused in nftables mode")),
    case("iptables.minSyncPeriod", "mode: iptables\niptables: {minSyncPeriod: 2s}", Honoured(|s| s.min_sync_period == Duration::from_secs(2))),
    case("iptables.minSyncPeriod", "mode: iptables\niptables: {minSyncPeriod: 1m}", Rejected),
    case("iptables.minSyncPeriod", "mode: iptables\niptables: {minSyncPeriod: -1s}", Rejected),
    case("ipvs.syncPeriod", "ipvs: {syncPeriod: 10s}", Warned("no ipvs mode")),
    case("ipvs.syncPeriod", "ipvs: {syncPeriod: 30s}", Honoured(|s| s.warnings.iter().all(|w| w.field != "ipvs"))),
    case("ipvs.minSyncPeriod", "ipvs: {minSyncPeriod: 10s}", Warned("no ipvs mode")),
    case("ipvs.scheduler", "ipvs: {scheduler: rr}", Warned("no ipvs mode")),
    case("ipvs.excludeCIDRs", "ipvs: {excludeCIDRs: [10.0.0.0/8]}", Warned("no ipvs mode")),
    case("ipvs.strictARP", "ipvs: {strictARP: true}", Warned("no ipvs mode")),
    case("ipvs.tcpTimeout", "ipvs: {tcpTimeout: 10s}", Warned("no ipvs mode")),
    case("ipvs.tcpFinTimeout", "ipvs: {tcpFinTimeout: 10s}", Warned("no ipvs mode")),
    case("ipvs.udpTimeout", "ipvs: {udpTimeout: 10s}", Warned("no ipvs mode")),
    case("nftables.masqueradeBit", "nftables: {masqueradeBit: 3}", Honoured(|s| s.build.masquerade_bit == 3)),
    case("nftables.masqueradeBit", "nftables: {masqueradeBit: 32}", Rejected),
    case("nftables.masqueradeBit", "nftables: {masqueradeBit: -1}", Rejected),
    case("nftables.masqueradeBit", "mode: iptables\nnftables: {masqueradeBit: 3}", Warned("unused in iptables mode")),
    case("nftables.masqueradeAll", "nftables: {masqueradeAll: true}", Honoured(|s| s.build.masquerade_all)),
    case("nftables.syncPeriod", "nftables: {syncPeriod: 10s}", Honoured(|s| s.sync_period == Duration::from_secs(10))),
    case("nftables.syncPeriod", "nftables: {syncPeriod: -5s}", Rejected),
    case("nftables.syncPeriod", "nftables: {syncPeriod: soon}", Rejected),
    case("nftables.syncPeriod", "nftables: {syncPeriod: 500ms}", Rejected),
    case("nftables.minSyncPeriod", "nftables: {minSyncPeriod: 250ms}", Honoured(|s| s.min_sync_period == Duration::from_millis(250))),
    case("nftables.minSyncPeriod", "nftables: {minSyncPeriod: 1m}", Rejected),
    case("winkernel.networkName", "winkernel: {networkName: cbr0}", Warned("Windows only")),
    case("winkernel.sourceVip", "winkernel: {sourceVip: 10.0.0.1}", Warned("Windows only")),
    case("winkernel.enableDSR", "winkernel: {enableDSR: true}", Warned("Windows only")),
    case("winkernel.rootHnsEndpointName", "winkernel: {rootHnsEndpointName: cbr0}", Warned("Windows only")),
    case("winkernel.forwardHealthCheckVip", "winkernel: {forwardHealthCheckVip: true}", Warned("Windows only")),
    case("detectLocalMode", "detectLocalMode: NodeCIDR", Honoured(|s| s.build.local_detector == LocalDetector::NodeCidr)),
    case("detectLocalMode", "detectLocalMode: \"\"\nclusterCIDR: 10.0.0.0/8", Honoured(|s| matches!(s.build.local_detector, LocalDetector::ClusterCidr(_)))),
    case("detectLocalMode", "detectLocalMode: Magic", Rejected),
    case("detectLocal.bridgeInterface", "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}", Honoured(|s| s.build.local_detector == LocalDetector::BridgeInterface("cbr0".into()))),
    case("detectLocal.bridgeInterface", "detectLocalMode: BridgeInterface", Rejected),
    case("detectLocal.bridgeInterface", "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: a-very-long-bridge}", Rejected),
    case("detectLocal.interfaceNamePrefix", "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}", Honoured(|s| s.build.local_detector == LocalDetector::InterfaceNamePrefix("veth".into()))),
    case("detectLocal.interfaceNamePrefix", "detectLocalMode: InterfaceNamePrefix", Rejected),
    case("detectLocal.interfaceNamePrefix", "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: abcdefghijklmnop}", Rejected),
    case("clusterCIDR", "clusterCIDR: 10.0.0.0/8,fd00:10::/64", Honoured(|s| matches!(s.build.local_detector, LocalDetector::ClusterCidr(ref c) if c.len() == 2))),
    case("clusterCIDR", "clusterCIDR: 10.0.0.0/33", Rejected),
    case("clusterCIDR", "clusterCIDR: 10.0.0.0/8,10.1.0.0/16", Rejected),
    case("clusterCIDR", "clusterCIDR: 10.0.0.0/8,fd00::/64,10.1.0.0/16", Rejected),
    case("clusterCIDR", "clusterCIDR: \"10.0.0.0/8,\"", Rejected),
    case("nodePortAddresses", "nodePortAddresses: [192.168.0.0/24, \"fd00::/64\"]", Honoured(|s| matches!(s.build.node_port_addresses, NodePortAddresses::Cidrs(ref c) if c.len() == 2))),
    case("nodePortAddresses", "mode: iptables\nnodePortAddresses: [primary]", Honoured(|s| s.build.node_port_addresses == NodePortAddresses::Primary)),
    case("nodePortAddresses", "nodePortAddresses: [primary, 10.0.0.0/8]", Rejected),
    case("nodePortAddresses", "nodePortAddresses: [10.0.0.0/8, primary]", Rejected),
    case("nodePortAddresses", "nodePortAddresses: [nope]", Rejected),
    case("oomScoreAdj", "oomScoreAdj: 100", Honoured(|s| s.oom_score_adj == 100)),
    case("oomScoreAdj", "oomScoreAdj: 1001", Rejected),
    case("oomScoreAdj", "oomScoreAdj: -1001", Rejected),
    case("conntrack.maxPerCore", "conntrack: {maxPerCore: 1000}", Warned("conntrack.maxPerCore=1000")),
    case("conntrack.maxPerCore", "conntrack: {maxPerCore: -1}", Rejected),
    case("conntrack.min", "conntrack: {min: 5}", Warned("conntrack.min=5")),
    case("conntrack.min", "conntrack: {min: -1}", Rejected),
    case("conntrack.tcpEstablishedTimeout", "conntrack: {tcpEstablishedTimeout: 2h}", Warned("nf_conntrack_tcp_timeout_established=7200")),
    case("conntrack.tcpEstablishedTimeout", "conntrack: {tcpEstablishedTimeout: -2h}", Rejected),
    case("conntrack.tcpCloseWaitTimeout", "conntrack: {tcpCloseWaitTimeout: 30s}", Warned("nf_conntrack_tcp_timeout_close_wait=30")),
    case("conntrack.tcpCloseWaitTimeout", "conntrack: {tcpCloseWaitTimeout: -30s}", Rejected),
    case("conntrack.tcpBeLiberal", "conntrack: {tcpBeLiberal: true}", Warned("nf_conntrack_tcp_be_liberal=1")),
    case("conntrack.tcpBeLiberal", "mode: iptables\nconntrack: {tcpBeLiberal: true}", Honoured(|s| !s.iptables.drop_invalid)),
    case("conntrack.udpTimeout", "conntrack: {udpTimeout: 30s}", Warned("nf_conntrack_udp_timeout=30")),
    case("conntrack.udpTimeout", "conntrack: {udpTimeout: -30s}", Rejected),
    case("conntrack.udpStreamTimeout", "conntrack: {udpStreamTimeout: 2m}", Warned("nf_conntrack_udp_timeout_stream=120")),
    case("conntrack.udpStreamTimeout", "conntrack: {udpStreamTimeout: -2m}", Rejected),
    case("configSyncPeriod", "configSyncPeriod: 1m", Warned("not resynced")),
    case("configSyncPeriod", "configSyncPeriod: 15m", Honoured(|s| s.warnings.iter().all(|w| w.field != "configSyncPeriod"))),
    case("configSyncPeriod", "configSyncPeriod: -1m", Rejected),
    case("portRange", "portRange: 30000-32767", Warned("userspace")),
    case("portRange", "portRange: 2000-300", Rejected),
    case("portRange", "portRange: abc", Rejected),
    case("portRange", "portRange: 70000", Rejected),
    case("windowsRunAsService", "windowsRunAsService: true", Warned("Windows only")),
];

#[test]
pub(super) fn every_field_is_honoured_warned_or_rejected() {
    for Case {
        field,
        yaml,
        expect,
    } in CASES
    {
        match (expect, outcome(yaml)) {
            (Honoured(check), Ok(s)) => assert!(check(&s), "{field}: not honoured: {yaml}"),
            (Warned(text), Ok(s)) => {
                let named = warnings_naming(&s, field);
                assert!(
                    named.iter().any(|w| w.message.contains(text)),
                    "{field}: no warning with {text:?} for {yaml}: {:#?}",
                    s.warnings
                );
            }
            (Rejected, Err(e)) => assert!(e.contains(field), "{field}: {yaml}: {e}"),
            (Rejected, Ok(_)) => panic!("{field}: accepted: {yaml}"),
            (_, Err(e)) => panic!("{field}: rejected: {yaml}: {e}"),
        }
    }
}

/// The paths of a JSON document's leaves; maps of arbitrary keys count as leaves.
pub(super) fn leaf_paths(v: &Value, path: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(map) if !map.is_empty() && path != "featureGates" => {
            for (k, child) in map {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaf_paths(child, &p, out);
            }
        }
        _ => {
            out.insert(path.to_string());
        }
    }
}

pub(super) fn paths(v: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    leaf_paths(v, "", &mut out);
    out
}

#[test]
pub(super) fn the_field_list_is_the_model_and_every_field_has_a_case() {
    let listed: BTreeSet<String> = FIELDS.iter().map(|f| f.to_string()).collect();
    assert_eq!(listed.len(), FIELDS.len(), "FIELDS has duplicates");
    let model = serde_json::to_value(KubeProxyConfiguration::default()).unwrap();
    assert_eq!(paths(&model), listed, "the model's fields vs FIELDS");
    let effective = resolve(KUBEADM_CONFIG).unwrap().effective;
    assert_eq!(
        paths(&effective),
        listed,
        "the effective configuration vs FIELDS"
    );
    let covered: BTreeSet<String> = CASES.iter().map(|c| c.field.to_string()).collect();
    let missing: Vec<&String> = listed.difference(&covered).collect();
    assert!(missing.is_empty(), "fields without a case: {missing:?}");
    let strays: Vec<&String> = covered.difference(&listed).collect();
    assert!(strays.is_empty(), "cases for no field: {strays:?}");
}

#[test]
pub(super) fn the_documentation_covers_every_field() {
    let doc = include_str!("../../../../README.md");
    let missing: Vec<&&str> = FIELDS
        .iter()
        .filter(|f| !doc.contains(&format!("`{f}`")))
        .collect();
    assert!(missing.is_empty(), "README.md lacks {missing:?}");
}
