//! Fuzzing of what the agent reads from files and from the kernel: the YAML file source, the
//! kube-proxy configuration (parsed and resolved), the nf_tables dump decoder (raw bytes,
//! generated attribute trees, and real messages from the encoder, mutated), the netlink reply
//! and notification readers, and the conntrack decoder. Each target asserts that nothing panics,
//! that every call returns within the time limit, and where there is one, a round trip
//! (encode → decode of a table gives the state the planner expects; a conntrack entry decodes to
//! the flow it was built from; a Go duration prints and parses back).
//!
//! No root needed: nothing here opens a socket. Cases per target: `NFTPROXY_FUZZ_CASES`
//! (small by default); see `dataplane/tests/fuzz/harness.rs` and `scripts/fuzz.sh`.

#[path = "../../dataplane/tests/fuzz/harness.rs"]
mod harness;
#[path = "../../dataplane/tests/fuzz/k8s.rs"]
mod k8s;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use dataplane::conntrack::{Frontends, Tuple, is_stale};
use dataplane::convert;
use dataplane::nft::build::{BuildConfig, LocalDetector, NodePortAddresses, build};
use dataplane::nft::desired::Before;
use dataplane::nft::plan::{plan, plan_cleanup};
use dataplane::nft::ruleset::{Family, Table};
use dataplane::nft::state::TableState;
use dataplane::tracker::Tracker;
use harness::fuzz;
use netlink_packet_core::{DefaultNla, NetlinkMessage};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol, Tuple as CtTuple,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};
use nftproxy::config::{GoDuration, KubeProxyConfiguration, Overrides, Settings, parse_duration};
use nftproxy::conntrack::{Flow, decode_datagram};
use nftproxy::nftables::monitor::foreign_change;
use nftproxy::nftables::{NftError, datagram_replies, decode_state, transaction_messages};
use nftproxy::ratelimit::Bucket;
use nftproxy::source;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::Value;

const KUBEADM_CONFIG: &str = include_str!("../../tests/fixtures/kubeadm-kube-proxy-config.conf");
const CLUSTER_IP_CONFIG: &str = include_str!("../../tests/fixtures/cluster-ip-config.yaml");
const DEMO_CLUSTER: &str = include_str!("../../examples/demo-cluster.yaml");
const EXAMPLE_CLUSTER: &str = include_str!("../../examples/cluster.yaml");
const MALFORMED: &str = include_str!("../../tests/fixtures/malformed.yaml");

// ---------------------------------------------------------------------------------------------
// The YAML file source.

fn proxy_name() -> impl Strategy<Value = String> {
    prop_oneof![4 => Just(String::new()), 1 => Just("other".to_string())]
}

/// A file the source could be given: generated objects (valid or not), or one of the examples,
/// with random edits.
fn cluster_file() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => k8s::yaml_file(10).prop_map(|f| f.text()),
        2 => (k8s::valid_cluster(6), vec(k8s::edit(), 0..4)).prop_map(|(c, edits)| {
            let mut text = c.yaml();
            k8s::apply_edits(&mut text, &edits);
            text
        }),
        2 => (
            select(vec![DEMO_CLUSTER, EXAMPLE_CLUSTER, MALFORMED]),
            vec(k8s::edit(), 0..6)
        )
            .prop_map(|(text, edits)| {
                let mut text = text.to_string();
                k8s::apply_edits(&mut text, &edits);
                text
            }),
        1 => k8s::yaml_trap(),
        1 => vec(any::<u8>(), 0..400).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

/// `load_text` (render, trace, `--once`) and `load_into` (the followed file, through the
/// tracker) on the same text: both succeed or both fail, and on success agree on the Services.
#[test]
fn source_load() {
    fuzz(
        "source_load",
        60,
        (cluster_file(), proxy_name()),
        |(text, proxy)| {
            let loaded = source::load_text(&text, "node", &proxy);
            let path = std::env::temp_dir().join(format!(
                "nftproxy-fuzz-{}-{:?}.yaml",
                std::process::id(),
                std::thread::current().id()
            ));
            std::fs::write(&path, &text).expect("temp file");
            let mut tracker = Tracker::new("node", &proxy);
            let into = source::load_into(&mut tracker, &path);
            let _ = std::fs::remove_file(&path);
            assert_eq!(loaded.is_ok(), into.is_ok(), "{loaded:?} vs {into:?}");
            if let Ok((cluster, _)) = loaded {
                harness::note("source_load", "loaded");
                // Both read the file through the same re-list: they agree on the Services even
                // when one is listed twice (the last copy wins, valid or not).
                let (objects, _) =
                    dataplane::input::parse_yaml(&text).expect("parsed once already");
                let mut seen = std::collections::BTreeSet::new();
                if !objects
                    .services
                    .iter()
                    .all(|s| seen.insert(convert::object_name(&s.metadata)))
                {
                    harness::note("source_load", "duplicate_services");
                }
                let names =
                    |c: &dataplane::model::Cluster| c.services.keys().cloned().collect::<Vec<_>>();
                assert_eq!(names(&cluster), names(tracker.cluster()));
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// The configuration.

fn config_string() -> BoxedStrategy<String> {
    prop_oneof![
        3 => select(vec![
            // Durations.
            "30s", "1m30s", "500ms", "0", "0s", "-1s", "1.5h", ".5s", "5.s", "1e3s", "1h1m1s1ms1us1ns",
            "9223372036854775807ns", "9223372036854775808ns", "2562047h", "2562048h", "-2562047h",
            "1µs", "1μs", "s", "1", "+1s", "--1s", "1.0000000000000000000001s",
            // Modes, formats, detect-local modes.
            "nftables", "iptables", "ipvs", "kernelspace", "", "text", "json", "ClusterCIDR",
            "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix",
            // Addresses.
            "0.0.0.0", "::", "127.0.0.1", "::1", "0.0.0.0:10256", "[::]:10256", "1.2.3.4:0",
            "1.2.3.4:65536", "host:80", "[::1]", "[::1]:", ":80", "1.2.3.4:-1", "::ffff:1.2.3.4",
            "010.001.002.003", "[1.2.3.4]:80", "1.2.3.4:99999999999999999999",
            // CIDRs, lists of them, and the rest.
            "10.0.0.0/8", "10.0.0.0/8,fd00::/48", "10.0.0.0/8,10.1.0.0/16", "a,b,c", "primary",
            "0", "64Ki", "1e3", "1.5M", "--1", "+.5", "1.33", "1.", ".1", "300-2000",
            "300+1700", "65535+1", "9223372036854775807+9223372036854775807", "-5", "1-2-3",
            "cbr0", "veth", "averyveryverylonginterfacename", "application/json",
            "application/vnd.kubernetes.protobuf", "kubeproxy.config.k8s.io/v1alpha1",
            "KubeProxyConfiguration",
        ])
        .prop_map(str::to_string),
        1 => "[0-9]{1,25}(ns|us|ms|s|m|h)",
        1 => "([0-9]{0,3}\\.?[0-9]{0,3}(ns|us|ms|s|m|h|d|x)?){1,6}",
        1 => k8s::weird_string(),
    ]
    .boxed()
}

fn config_number() -> BoxedStrategy<Value> {
    prop_oneof![
        3 => k8s::int_value(),
        1 => select(vec![0.0, -0.0, 1e-45, 1e-300, 0.5, 1e38, 3.5e38, 1e300, -1.0, 5.0])
            .prop_map(Value::from),
        1 => Just(Value::from(u64::MAX)),
    ]
    .boxed()
}

/// Plausible text for the string field `key`: mostly what kube-proxy accepts there, sometimes
/// anything from [`config_string`].
fn config_string_for(key: &str) -> BoxedStrategy<String> {
    let good: Vec<&'static str> = match key {
        k if k.ends_with("Period") || k.ends_with("Timeout") || k == "flushFrequency" => vec![
            "30s", "1m30s", "500ms", "0s", "1s", "15m", "1h", "2h45m", "100ms", "-1s", "10s",
        ],
        "mode" => vec!["nftables", "iptables", "", "ipvs"],
        "format" => vec!["text", "json", ""],
        "detectLocalMode" => vec![
            "ClusterCIDR",
            "NodeCIDR",
            "BridgeInterface",
            "InterfaceNamePrefix",
            "",
        ],
        "bindAddress" => vec!["0.0.0.0", "::", "10.0.0.1", "fd00::1", ""],
        "healthzBindAddress" | "metricsBindAddress" => vec![
            "0.0.0.0:10256",
            "127.0.0.1:10249",
            "[::]:10256",
            "[::1]:10249",
            "10.0.0.1",
            "",
            "0.0.0.0:0",
        ],
        "clusterCIDR" => vec!["10.0.0.0/8", "10.0.0.0/8,fd00::/48", "", "fd00::/48"],
        "bridgeInterface" | "interfaceNamePrefix" => vec!["cbr0", "veth", "", "eth"],
        "portRange" => vec!["", "300-2000", "300+1700", "8080"],
        "showHiddenMetricsForVersion" => vec!["", "1.32", "1.33"],
        "infoBufferSize" => vec!["0", "64Ki", "", "1M"],
        "apiVersion" => vec!["kubeproxy.config.k8s.io/v1alpha1"],
        "kind" => vec!["KubeProxyConfiguration"],
        "contentType" | "acceptContentTypes" => {
            vec![
                "",
                "application/json",
                "application/vnd.kubernetes.protobuf",
            ]
        }
        "hostnameOverride" => vec!["", "node", " Node-1 "],
        _ => vec!["", "x"],
    };
    prop_oneof![12 => select(good).prop_map(str::to_string), 1 => config_string()].boxed()
}

/// A plausible number for the numeric field `key`.
fn config_number_for(key: &str) -> BoxedStrategy<Value> {
    let good = match key {
        "masqueradeBit" => (0i64..32).boxed(),
        "verbosity" => (0i64..10).boxed(),
        "oomScoreAdj" => (-1000i64..=1000).boxed(),
        "burst" | "maxPerCore" | "min" => (0i64..100_000).boxed(),
        _ => (0i64..100).boxed(),
    };
    prop_oneof![
        12 => good.prop_map(Value::from),
        1 => config_number(),
    ]
    .boxed()
}

/// A value for field `key`, whose default (in `schema`) has this shape: right almost always,
/// wrong sometimes (more wrongness comes from the edits of the whole document).
fn config_value(key: &str, schema: &Value) -> BoxedStrategy<Value> {
    let wrong = || k8s::any_json(2);
    match (key, schema) {
        ("featureGates", _) => prop_oneof![
            30 => vec(
                (
                    select(vec!["LoggingAlphaOptions", "LoggingBetaOptions", "Bogus", ""])
                        .prop_map(str::to_string),
                    prop_oneof![30 => any::<bool>().prop_map(Value::Bool), 1 => wrong()],
                ),
                0..3
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            1 => wrong(),
        ]
        .boxed(),
        ("vmodule", _) => prop_oneof![
            30 => vec(
                config_object(&serde_json::json!({"filePattern": "", "verbosity": 0})),
                0..3
            )
            .prop_map(Value::Array),
            1 => wrong(),
        ]
        .boxed(),
        ("nodePortAddresses" | "excludeCIDRs", _) => prop_oneof![
            10 => vec(
                select(vec!["primary", "10.0.0.0/8", "fd00::/64", "0.0.0.0/0", "127.0.0.1/32"])
                    .prop_map(Value::from),
                0..3
            )
            .prop_map(Value::Array),
            1 => Just(Value::Null),
            1 => vec(config_string().prop_map(Value::String), 0..3).prop_map(Value::Array),
            1 => wrong(),
        ]
        .boxed(),
        ("flushFrequency", _) => prop_oneof![
            10 => config_string_for(key).prop_map(Value::String),
            2 => config_number(),
            1 => wrong(),
        ]
        .boxed(),
        ("qps", _) => prop_oneof![
            6 => (0u32..100).prop_map(Value::from),
            2 => select(vec![0.5, 1e-30, 1e-45, 3.4e38, 1e300, -1.0, 0.0]).prop_map(Value::from),
            1 => wrong(),
        ]
        .boxed(),
        (_, Value::Object(_)) => config_object(schema),
        (_, Value::String(_)) => prop_oneof![
            40 => config_string_for(key).prop_map(Value::String),
            1 => config_number(),
            1 => wrong(),
        ]
        .boxed(),
        (_, Value::Number(_)) => prop_oneof![
            40 => config_number_for(key),
            1 => config_string().prop_map(Value::String),
            1 => wrong(),
        ]
        .boxed(),
        (_, Value::Bool(_)) => prop_oneof![
            40 => any::<bool>().prop_map(Value::Bool),
            1 => select(vec!["true", "yes", "on", "1"]).prop_map(Value::from),
            1 => wrong(),
        ]
        .boxed(),
        (_, Value::Array(_)) => prop_oneof![
            20 => vec(config_string_for(key).prop_map(Value::String), 0..3).prop_map(Value::Array),
            1 => wrong(),
        ]
        .boxed(),
        // Pointer fields (`null` by default): numbers, booleans, durations.
        (_, Value::Null) => {
            let typed = match key {
                "localhostNodePorts" => any::<bool>().prop_map(Value::Bool).boxed(),
                k if k.ends_with("Timeout") => config_string_for(k).prop_map(Value::String).boxed(),
                _ => config_number_for(key),
            };
            prop_oneof![
                20 => typed,
                4 => Just(Value::Null),
                1 => config_number(),
                1 => config_string().prop_map(Value::String),
                1 => wrong(),
            ]
            .boxed()
        }
    }
}

/// An object with the fields of `schema` (each present with probability 1/2), sometimes an
/// unknown key or one that differs from a known one only in letter case.
fn config_object(schema: &Value) -> BoxedStrategy<Value> {
    let Value::Object(known) = schema else {
        return k8s::any_json(2);
    };
    let fields: Vec<BoxedStrategy<Option<(String, Value)>>> = known
        .iter()
        .map(|(k, v)| {
            let key = k.clone();
            let p = if matches!(k.as_str(), "apiVersion" | "kind") {
                0.95
            } else {
                0.5
            };
            proptest::option::weighted(p, config_value(k, v).prop_map(move |v| (key.clone(), v)))
                .boxed()
        })
        .collect();
    let keys: Vec<String> = known.keys().cloned().collect();
    let extra = prop_oneof![
        6 => Just(Vec::new()),
        1 => vec(
            prop_oneof![
                "[a-zA-Z]{1,10}",
                select(keys).prop_map(|k| k.to_uppercase()),
            ],
            1..3,
        ),
    ];
    (fields, extra, k8s::any_json(1))
        .prop_map(|(fields, extra, value)| {
            let mut m = serde_json::Map::new();
            for k in extra {
                m.insert(k, value.clone());
            }
            for (k, v) in fields.into_iter().flatten() {
                m.insert(k, v);
            }
            Value::Object(m)
        })
        .boxed()
}

fn overrides() -> impl Strategy<Value = Overrides> {
    let text = |values: Vec<&'static str>| {
        proptest::option::of(prop_oneof![
            4 => select(values).prop_map(str::to_string),
            1 => k8s::weird_string(),
        ])
    };
    (
        text(vec!["node", " Node-A ", "", "  "]),
        text(vec!["nftables", "iptables", "ipvs", ""]),
        text(vec!["/etc/kubernetes/kubeconfig", ""]),
        text(vec!["https://10.0.0.1:6443", " https://api:6443 ", ""]),
        proptest::option::of(prop_oneof![
            0u32..10,
            Just(i32::MAX as u32),
            Just(i32::MAX as u32 + 1),
            Just(u32::MAX)
        ]),
        text(vec!["text", "json", "yaml"]),
    )
        .prop_map(
            |(hostname_override, proxy_mode, kubeconfig, master, verbosity, log_format)| {
                Overrides {
                    hostname_override,
                    proxy_mode,
                    kubeconfig,
                    master,
                    verbosity,
                    log_format,
                }
            },
        )
}

/// The configuration text: a generated document (as YAML or JSON), or kube-proxy's own
/// examples, edited.
fn config_text() -> impl Strategy<Value = String> {
    let schema = serde_json::to_value(KubeProxyConfiguration::default()).expect("schema");
    prop_oneof![
        6 => (
            config_object(&schema),
            any::<bool>(),
            prop_oneof![3 => Just(Vec::new()), 1 => vec(k8s::json_edit(), 1..3)],
            prop_oneof![3 => Just(Vec::new()), 1 => vec(k8s::edit(), 1..3)],
        )
            .prop_map(|(mut doc, as_json, json_edits, edits)| {
                k8s::apply_json_edits(&mut doc, &json_edits);
                if let Value::Object(m) = &mut doc {
                    m.entry("apiVersion")
                        .or_insert_with(|| "kubeproxy.config.k8s.io/v1alpha1".into());
                    m.entry("kind").or_insert_with(|| "KubeProxyConfiguration".into());
                }
                let mut text = if as_json {
                    serde_json::to_string(&doc).unwrap_or_default()
                } else {
                    serde_yaml_ng::to_string(&doc).unwrap_or_default()
                };
                k8s::apply_edits(&mut text, &edits);
                text
            }
        ),
        2 => (select(vec![KUBEADM_CONFIG, CLUSTER_IP_CONFIG]), vec(k8s::edit(), 0..6)).prop_map(
            |(text, edits)| {
                let mut text = text.to_string();
                k8s::apply_edits(&mut text, &edits);
                text
            }
        ),
        1 => k8s::yaml_trap(),
        1 => any::<String>(),
    ]
}

/// Uses the client rate limit the way the API client does, over a simulated hour.
fn exercise_bucket(qps: f32, burst: u32) {
    let start = Instant::now();
    let mut bucket = Bucket::new(qps, burst, start);
    let mut now = start;
    for step in 0..50u64 {
        let wait = bucket.wait(now);
        now += wait.min(Duration::from_secs(3600)) + Duration::from_millis(step * 7);
        bucket.take(now);
    }
}

#[test]
fn config_parse_and_resolve() {
    fuzz(
        "config_parse_and_resolve",
        150,
        (config_text(), overrides()),
        |(text, overrides)| {
            let Ok(file) = KubeProxyConfiguration::parse(&text) else {
                return;
            };
            harness::note("config_parse_and_resolve", "parsed");
            let Ok(settings) = Settings::resolve(&file, &overrides) else {
                return;
            };
            harness::note("config_parse_and_resolve", "resolved");
            // What the agent then does with the settings must not fail either.
            assert!(settings.min_sync_period <= settings.sync_period);
            assert!(settings.build.masquerade_bit <= 31);
            for addr in [
                &settings.metrics_bind_address,
                &settings.healthz_bind_address,
            ] {
                addr.parse::<std::net::SocketAddr>()
                    .unwrap_or_else(|e| panic!("listener {addr:?}: {e}"));
            }
            let _ = serde_json::to_string(&settings.effective).expect("effective config");
            for w in &settings.warnings {
                let _ = w.to_string();
            }
            exercise_bucket(settings.client.qps, settings.client.burst);
        },
    );
}

/// Go durations: parsing never panics; a parsed duration prints (as Go prints it) and parses
/// back to the same value, and any value does.
#[test]
fn go_durations() {
    fuzz(
        "go_durations",
        1000,
        (
            prop_oneof![config_string(), any::<String>()],
            prop_oneof![
                any::<i64>(),
                -1_000_000_000_000i64..1_000_000_000_000,
                Just(i64::MIN),
                Just(i64::MAX)
            ],
        ),
        |(text, nanos)| {
            if let Ok(d) = GoDuration::parse(&text) {
                assert_eq!(GoDuration::parse(&d.to_string()), Ok(d), "{text:?}");
            }
            let _ = parse_duration(&text);
            let d = GoDuration(nanos);
            assert_eq!(GoDuration::parse(&d.to_string()), Ok(d));
            let _ = d.to_std();
            let _ = d.whole_secs();
        },
    );
}

// ---------------------------------------------------------------------------------------------
// nf_tables dumps.

const NLMSG_HDRLEN: usize = 16;
const NLA_F_NESTED: u16 = 1 << 15;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;

/// A netlink attribute: a leaf, or a nest of attributes.
#[derive(Clone, Debug, PartialEq)]
enum Nla {
    Leaf(u16, Vec<u8>),
    Nest(u16, Vec<Nla>),
}

/// The attributes of `buf` if it is exactly a list of well-formed attributes.
fn split_nlas(buf: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    let mut rest = buf;
    while !rest.is_empty() {
        if rest.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        if len < 4 || len > rest.len() {
            return None;
        }
        out.push((u16::from_ne_bytes([rest[2], rest[3]]), &rest[4..len]));
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
    }
    Some(out)
}

/// The attribute tree of `buf`: a payload that is itself a list of attributes is a nest.
fn tree(buf: &[u8]) -> Vec<Nla> {
    match split_nlas(buf) {
        Some(nlas) => nlas
            .into_iter()
            .map(|(kind, value)| match split_nlas(value) {
                Some(inner)
                    if !inner.is_empty() && (kind & NLA_F_NESTED != 0 || value.len() >= 8) =>
                {
                    Nla::Nest(kind, tree(value))
                }
                _ => Nla::Leaf(kind, value.to_vec()),
            })
            .collect(),
        None => vec![Nla::Leaf(0xffff, buf.to_vec())],
    }
}

fn emit(nlas: &[Nla], out: &mut Vec<u8>) {
    for nla in nlas {
        let at = out.len();
        out.extend_from_slice(&[0, 0, 0, 0]);
        let kind = match nla {
            Nla::Leaf(kind, value) => {
                if *kind == 0xffff {
                    // An unparsed remainder: as it was.
                    out.truncate(at);
                    out.extend_from_slice(value);
                    continue;
                }
                out.extend_from_slice(value);
                *kind
            }
            Nla::Nest(kind, inner) => {
                emit(inner, out);
                *kind
            }
        };
        let len = (out.len() - at).min(usize::from(u16::MAX)) as u16;
        out[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        out[at + 2..at + 4].copy_from_slice(&kind.to_ne_bytes());
        out.resize((out.len() + 3) & !3, 0);
    }
}

/// A message with a netlink header, an nfgenmsg and `nlas`.
fn message(kind: u16, family: u8, nlas: &[Nla]) -> Vec<u8> {
    let mut out = vec![0; NLMSG_HDRLEN];
    out.extend_from_slice(&[family, 0, 0, 0]);
    emit(nlas, &mut out);
    let len = out.len() as u32;
    out[0..4].copy_from_slice(&len.to_ne_bytes());
    out[4..6].copy_from_slice(&kind.to_ne_bytes());
    out
}

fn msg_type(msg: &[u8]) -> u16 {
    msg.get(4..6)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .unwrap_or(0)
}

/// A dump as the decoder takes it: chains, rules, sets, and the element dumps by set name.
#[derive(Clone, Debug, Default)]
struct Dump {
    chains: Vec<Vec<u8>>,
    rules: Vec<Vec<u8>>,
    sets: Vec<Vec<u8>>,
    elements: BTreeMap<String, Vec<Vec<u8>>>,
}

fn set_name_of(msg: &[u8]) -> String {
    let nlas = msg
        .get(NLMSG_HDRLEN + 4..)
        .and_then(split_nlas)
        .unwrap_or_default();
    nlas.iter()
        .find(|(k, _)| k & 0x3fff == NFTA_SET_ELEM_LIST_SET)
        .map(|(_, v)| {
            String::from_utf8_lossy(v)
                .trim_end_matches('\0')
                .to_string()
        })
        .unwrap_or_default()
}

impl Dump {
    /// Sorts messages into the dumps the kernel would answer them in (by their type).
    fn of(messages: &[Vec<u8>]) -> Dump {
        let mut d = Dump::default();
        for m in messages {
            let kind = msg_type(m);
            if kind >> 8 != NFNL_SUBSYS_NFTABLES {
                continue;
            }
            match kind & 0xff {
                NFT_MSG_NEWCHAIN => d.chains.push(m.clone()),
                NFT_MSG_NEWRULE => d.rules.push(m.clone()),
                NFT_MSG_NEWSET => d.sets.push(m.clone()),
                NFT_MSG_NEWSETELEM => d
                    .elements
                    .entry(set_name_of(m))
                    .or_default()
                    .push(m.clone()),
                _ => {}
            }
        }
        d
    }

    fn all_mut(&mut self) -> Vec<&mut Vec<u8>> {
        self.chains
            .iter_mut()
            .chain(self.rules.iter_mut())
            .chain(self.sets.iter_mut())
            .chain(self.elements.values_mut().flatten())
            .collect()
    }

    /// Decodes the dump; element dumps of sets it does not hold answer `missing`.
    fn decode(
        &self,
        family: Family,
        missing: ElementAnswer,
    ) -> Result<Option<TableState>, NftError> {
        decode_state(family, &self.chains, &self.rules, &self.sets, |set| match (
            self.elements.get(set),
            missing,
        ) {
            (Some(msgs), _) => Ok(Some(msgs.clone())),
            (None, ElementAnswer::Empty) => Ok(Some(Vec::new())),
            (None, ElementAnswer::Interrupted) => Ok(None),
            (None, ElementAnswer::Error) => Err(NftError::Decode {
                request: "element dump",
                reason: "fuzz".into(),
            }),
        })
    }
}

#[derive(Clone, Copy, Debug)]
enum ElementAnswer {
    Empty,
    Interrupted,
    Error,
}

fn element_answer() -> impl Strategy<Value = ElementAnswer> {
    prop_oneof![
        4 => Just(ElementAnswer::Empty),
        1 => Just(ElementAnswer::Interrupted),
        1 => Just(ElementAnswer::Error),
    ]
}

fn nft_config() -> impl Strategy<Value = BuildConfig> {
    let net = |s: &str| s.parse().unwrap();
    (
        prop_oneof![
            Just(LocalDetector::None),
            Just(LocalDetector::ClusterCidr(vec![
                net("10.0.0.0/8"),
                net("fd00::/8")
            ])),
            Just(LocalDetector::NodeCidr),
            Just(LocalDetector::BridgeInterface("cbr0".into())),
            Just(LocalDetector::InterfaceNamePrefix("veth".into())),
        ],
        prop_oneof![
            Just(NodePortAddresses::Primary),
            Just(NodePortAddresses::Cidrs(vec![
                net("0.0.0.0/0"),
                net("::/0")
            ])),
        ],
        any::<bool>(),
        0u32..32,
    )
        .prop_map(
            |(local_detector, node_port_addresses, masquerade_all, masquerade_bit)| BuildConfig {
                node_name: "node".into(),
                masquerade_all,
                masquerade_bit,
                local_detector,
                node_port_addresses,
                local_addresses: vec!["10.0.0.1".parse().unwrap(), "fd00::1".parse().unwrap()],
            },
        )
}

fn family() -> impl Strategy<Value = Family> {
    prop_oneof![Just(Family::V4), Just(Family::V6)]
}

/// The desired table of a generated valid cluster.
fn desired(cluster: &k8s::ValidCluster, config: &BuildConfig, family: Family) -> Table {
    let (objects, _) = dataplane::input::parse_yaml(&cluster.yaml()).expect("valid YAML");
    let (model, skipped) = convert::cluster(&objects, "node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    build(&model, config, family).table
}

/// Everything the agent does with a state it read: plan against it, clean up, find the UDP
/// frontends for conntrack cleanup.
fn use_state(state: &TableState, desired: &Table) {
    let tx = plan(Some(state), &Before::Nothing, desired);
    let mut after = state.clone();
    after.apply(&tx);
    let _ = plan_cleanup(&after, desired);
    let _ = Frontends::from_table_state(Some(state));
    let _ = dataplane::nft::render::transaction_text(&tx);
}

/// Encode → decode: the state read back from the messages nftproxy sends is the state the
/// planner expects after them, and planning against it finds nothing to do.
#[test]
fn nft_dump_round_trip() {
    fuzz(
        "nft_dump_round_trip",
        15,
        (k8s::valid_cluster(8), nft_config(), family()),
        |(cluster, config, family)| {
            let table = desired(&cluster, &config, family);
            let tx = plan(None, &Before::Nothing, &table);
            let messages = transaction_messages(&tx).expect("encodes");
            let dump = Dump::of(&messages);
            let state = dump
                .decode(family, ElementAnswer::Empty)
                .expect("decodes")
                .expect("complete");
            let mut expected = TableState::default();
            expected.apply(&tx);
            assert!(
                expected.agrees_with(&state, &table),
                "{state:?} read back, {expected:?} committed"
            );
            assert!(
                plan(Some(&state), &Before::Nothing, &table).is_empty(),
                "plan after read-back"
            );
            assert!(
                plan_cleanup(&state, &table).is_empty(),
                "cleanup after read-back"
            );
        },
    );
}

/// Interesting 32-bit values: register numbers, verdict codes, lengths, their edges.
fn interesting_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => select(vec![
            0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 20, 23, 24, 32, 255, 256, 0xffff, 0x1_0000,
            0x7fff_ffff, 0x8000_0000, 0xffff_fc18, 0xffff_fc19, 0xffff_fff0, u32::MAX - 1,
            u32::MAX, 0xffff_ff00, 0xffff_fffd, 0xffff_fffc,
        ]),
        1 => any::<u32>(),
    ]
}

/// One change to a message of a real dump.
#[derive(Clone, Debug)]
enum Mutation {
    /// Sets the `n`th 4-byte leaf (depth first) to a value, big- or host-endian.
    SetU32(usize, u32, bool),
    /// Replaces the `n`th leaf's value.
    SetLeaf(usize, Vec<u8>),
    /// Truncates the `n`th leaf's value.
    Shorten(usize, usize),
    /// Removes the `n`th attribute.
    Drop(usize),
    /// Repeats the `n`th attribute.
    Duplicate(usize),
    /// Gives the `n`th attribute another type.
    Retype(usize, u16),
    /// Moves the `n`th attribute into a nest of its own (or a nest's content up a level).
    Renest(usize),
    /// Flips bits of one byte of the message (header included).
    FlipByte(usize, u8),
    /// Cuts the message, fixing up its length or not.
    Truncate(usize, bool),
    /// Moves the message into another dump (rules as chains, ...).
    Misroute(u8),
    /// Copies the message (the kernel repeats entries when a dump is interrupted).
    Repeat,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        6 => (any::<usize>(), interesting_u32(), any::<bool>())
            .prop_map(|(n, v, be)| Mutation::SetU32(n, v, be)),
        2 => (
            any::<usize>(),
            prop_oneof![
                vec(any::<u8>(), 0..24),
                select(vec![
                    b"nftproxy\0".to_vec(), b"\0".to_vec(), vec![0xff; 16], vec![0; 16],
                    b"numgen\0".to_vec(), b"nat\0".to_vec(), b"ct\0".to_vec(),
                    b"lookup\0".to_vec(), b"immediate\0".to_vec(), vec![0x80],
                ]),
            ]
        )
            .prop_map(|(n, v)| Mutation::SetLeaf(n, v)),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(n, k)| Mutation::Shorten(n, k)),
        2 => any::<usize>().prop_map(Mutation::Drop),
        1 => any::<usize>().prop_map(Mutation::Duplicate),
        2 => (any::<usize>(), prop_oneof![0u16..16, any::<u16>()])
            .prop_map(|(n, t)| Mutation::Retype(n, t)),
        1 => any::<usize>().prop_map(Mutation::Renest),
        2 => (any::<usize>(), 1u8..=255).prop_map(|(n, x)| Mutation::FlipByte(n, x)),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(n, f)| Mutation::Truncate(n, f)),
        1 => (0u8..4).prop_map(Mutation::Misroute),
        1 => Just(Mutation::Repeat),
    ]
}

/// Visits attributes depth first; `f` gets the list holding the `n`th one and its index.
fn with_nth(nlas: &mut Vec<Nla>, n: &mut usize, f: &mut dyn FnMut(&mut Vec<Nla>, usize)) -> bool {
    for i in 0..nlas.len() {
        if *n == 0 {
            f(nlas, i);
            return true;
        }
        *n -= 1;
        if let Nla::Nest(_, inner) = &mut nlas[i]
            && with_nth(inner, n, f)
        {
            return true;
        }
    }
    false
}

fn count(nlas: &[Nla]) -> usize {
    nlas.iter()
        .map(|n| match n {
            Nla::Nest(_, inner) => 1 + count(inner),
            Nla::Leaf(..) => 1,
        })
        .sum()
}

/// Calls `f` on the `n`th (modulo their number) attribute of `nlas`.
fn edit_nth(nlas: &mut Vec<Nla>, n: usize, f: &mut dyn FnMut(&mut Vec<Nla>, usize)) {
    let mut n = n % count(nlas).max(1);
    with_nth(nlas, &mut n, f);
}

/// The 4-byte leaves of `nlas`, depth first.
fn four_byte_leaves(nlas: &mut [Nla]) -> Vec<&mut Vec<u8>> {
    let mut out = Vec::new();
    for nla in nlas {
        match nla {
            Nla::Leaf(_, v) if v.len() == 4 => out.push(v),
            Nla::Nest(_, inner) => out.extend(four_byte_leaves(inner)),
            Nla::Leaf(..) => {}
        }
    }
    out
}

/// Message `at` (modulo their number) of `dump`.
fn nth_message(dump: &mut Dump, at: usize) -> Option<&mut Vec<u8>> {
    let mut all: Vec<&mut Vec<u8>> = dump.all_mut();
    if all.is_empty() {
        return None;
    }
    let i = at % all.len();
    Some(all.swap_remove(i))
}

/// `msg` with `m` applied.
fn mutated(msg: &[u8], m: &Mutation) -> Vec<u8> {
    if msg.len() < NLMSG_HDRLEN + 4 {
        return msg.to_vec();
    }
    let mut nlas = tree(&msg[NLMSG_HDRLEN + 4..]);
    match m {
        Mutation::SetU32(n, v, be) => {
            let mut leaves = four_byte_leaves(&mut nlas);
            if !leaves.is_empty() {
                let i = n % leaves.len();
                let bytes = if *be {
                    v.to_be_bytes()
                } else {
                    v.to_ne_bytes()
                };
                leaves[i].copy_from_slice(&bytes);
            }
        }
        Mutation::SetLeaf(n, value) => edit_nth(&mut nlas, *n, &mut |list, i| {
            if let Nla::Leaf(_, v) = &mut list[i] {
                *v = value.clone();
            }
        }),
        Mutation::Shorten(n, k) => edit_nth(&mut nlas, *n, &mut |list, i| {
            if let Nla::Leaf(_, v) = &mut list[i] {
                let keep = k % (v.len() + 1);
                v.truncate(keep);
            }
        }),
        Mutation::Drop(n) => edit_nth(&mut nlas, *n, &mut |list, i| {
            list.remove(i);
        }),
        Mutation::Duplicate(n) => edit_nth(&mut nlas, *n, &mut |list, i| {
            let copy = list[i].clone();
            list.insert(i, copy);
        }),
        Mutation::Retype(n, t) => edit_nth(&mut nlas, *n, &mut |list, i| match &mut list[i] {
            Nla::Leaf(kind, _) | Nla::Nest(kind, _) => *kind = *t,
        }),
        Mutation::Renest(n) => edit_nth(&mut nlas, *n, &mut |list, i| match list.remove(i) {
            Nla::Nest(_, inner) => {
                for (k, x) in inner.into_iter().enumerate() {
                    list.insert(i + k, x);
                }
            }
            leaf => list.insert(i, Nla::Nest(1 | NLA_F_NESTED, vec![leaf])),
        }),
        Mutation::FlipByte(..)
        | Mutation::Truncate(..)
        | Mutation::Misroute(_)
        | Mutation::Repeat => {}
    }
    let mut out = msg[..NLMSG_HDRLEN + 4].to_vec();
    emit(&nlas, &mut out);
    let len = out.len() as u32;
    out[0..4].copy_from_slice(&len.to_ne_bytes());
    match m {
        Mutation::FlipByte(n, x) => {
            let i = n % out.len();
            out[i] ^= x;
        }
        Mutation::Truncate(n, fix) => {
            out.truncate(n % (out.len() + 1));
            if *fix && out.len() >= 4 {
                let len = out.len() as u32;
                out[0..4].copy_from_slice(&len.to_ne_bytes());
            }
        }
        _ => {}
    }
    out
}

/// Applies `m` to message `at` of `dump`.
fn mutate(dump: &mut Dump, at: usize, m: &Mutation) {
    let Some(msg) = nth_message(dump, at) else {
        return;
    };
    *msg = mutated(msg, m);
    let copy = msg.clone();
    match m {
        Mutation::Misroute(0) => dump.chains.push(copy),
        Mutation::Misroute(1) | Mutation::Repeat => dump.rules.push(copy),
        Mutation::Misroute(2) => dump.sets.push(copy),
        Mutation::Misroute(_) => dump
            .elements
            .entry(set_name_of(&copy))
            .or_default()
            .push(copy),
        _ => {}
    }
}

/// Real messages of a real table, mutated: decoding never panics, and what decodes can be
/// planned against.
#[test]
fn nft_dump_mutated() {
    fuzz(
        "nft_dump_mutated",
        60,
        (
            k8s::valid_cluster(5),
            nft_config(),
            family(),
            vec((any::<usize>(), mutation()), 1..16),
            element_answer(),
        ),
        |(cluster, config, family, mutations, answer)| {
            let table = desired(&cluster, &config, family);
            let tx = plan(None, &Before::Nothing, &table);
            let messages = transaction_messages(&tx).expect("encodes");
            let mut dump = Dump::of(&messages);
            for (at, m) in &mutations {
                mutate(&mut dump, *at, m);
            }
            for f in Family::ALL {
                if let Ok(Some(state)) = dump.decode(f, answer) {
                    note_state("nft_dump_mutated", &state);
                    use_state(&state, &table);
                }
            }
        },
    );
}

/// Notes how far a decoded state got: decoded at all, chains whose rules were all understood.
fn note_state(target: &str, state: &TableState) {
    harness::note(target, "decoded");
    if state
        .chains
        .values()
        .any(|c| !c.empty && c.fingerprint.is_some())
    {
        harness::note(target, "rules_understood");
    }
    if state
        .sets
        .values()
        .any(|s| s.elements.read().is_some_and(|e| !e.is_empty()))
    {
        harness::note(target, "elements_understood");
    }
}

/// Expression names the decoder knows, and a few it does not.
fn expr_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => select(vec![
            "payload", "cmp", "bitwise", "meta", "lookup", "immediate", "ct", "fib", "numgen",
            "byteorder", "reject", "nat", "masq", "dynset", "counter", "log",
        ])
        .prop_map(|n| format!("{n}\0").into_bytes()),
        1 => vec(any::<u8>(), 0..10),
    ]
}

/// A leaf value: a 32-bit number, an address, a string, or anything.
fn leaf_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        5 => (interesting_u32(), any::<bool>())
            .prop_map(|(v, be)| if be { v.to_be_bytes().to_vec() } else { v.to_ne_bytes().to_vec() }),
        1 => select(vec![
            vec![10, 0, 0, 1], vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            vec![0xff, 0xff, 0xff, 0], vec![0; 16], vec![6], vec![17], vec![132], vec![0, 80],
            vec![3], vec![4], b"nftproxy\0".to_vec(), b"eth0\0\0\0\0\0\0\0\0\0\0\0\0".to_vec(),
            b"veth".to_vec(), b"cluster-endpoints-1\0".to_vec(), b"endpoints-3\0".to_vec(),
        ]),
        1 => vec(any::<u8>(), 0..20),
        1 => Just(Vec::new()),
    ]
}

/// A random attribute tree, types mostly among the small numbers nf_tables uses.
fn nla_tree(depth: u32) -> BoxedStrategy<Vec<Nla>> {
    let kind = prop_oneof![6 => 1u16..10, 1 => any::<u16>()];
    let leaf = (kind.clone(), leaf_value()).prop_map(|(k, v)| Nla::Leaf(k, v));
    let node = leaf.prop_recursive(depth, 48, 6, move |inner| {
        (
            prop_oneof![6 => 1u16..10, 1 => any::<u16>()],
            vec(inner, 0..6),
            any::<bool>(),
        )
            .prop_map(|(k, v, flag)| Nla::Nest(if flag { k | NLA_F_NESTED } else { k }, v))
    });
    vec(node, 0..8).boxed()
}

/// A rule message shaped like the ones nftproxy writes: table, chain, comment, and a list of
/// expressions with known names and attributes of plausible values.
fn rule_message() -> impl Strategy<Value = Vec<u8>> {
    let data = prop_oneof![
        3 => leaf_value().prop_map(|v| Nla::Leaf(1, v)),
        // NFTA_DATA_VALUE / NFTA_DATA_VERDICT nests.
        2 => leaf_value().prop_map(|v| Nla::Nest(1 | NLA_F_NESTED, vec![Nla::Leaf(1, v)])),
        1 => (interesting_u32(), proptest::option::of(select(vec!["c", "services", ""])))
            .prop_map(|(code, chain)| {
                let mut v = vec![Nla::Leaf(1, code.to_be_bytes().to_vec())];
                if let Some(c) = chain {
                    v.push(Nla::Leaf(2, format!("{c}\0").into_bytes()));
                }
                Nla::Nest(2 | NLA_F_NESTED, vec![Nla::Nest(2 | NLA_F_NESTED, v)])
            }),
    ];
    let attr = (1u16..10, data).prop_map(|(k, nla)| match nla {
        Nla::Leaf(_, v) => Nla::Leaf(k, v),
        Nla::Nest(_, v) => Nla::Nest(k | NLA_F_NESTED, v),
    });
    let expr = (expr_name(), vec(attr, 0..7)).prop_map(|(name, attrs)| {
        Nla::Nest(
            1 | NLA_F_NESTED,
            vec![Nla::Leaf(1, name), Nla::Nest(2 | NLA_F_NESTED, attrs)],
        )
    });
    (
        vec(expr, 0..8),
        proptest::option::of(vec(any::<u8>(), 0..12)),
        any::<bool>(),
    )
        .prop_map(|(exprs, udata, v6)| {
            let mut nlas = vec![
                Nla::Leaf(1, b"nftproxy\0".to_vec()),
                Nla::Leaf(2, b"services\0".to_vec()),
                Nla::Nest(4 | NLA_F_NESTED, exprs),
            ];
            if let Some(u) = udata {
                nlas.push(Nla::Leaf(7, u));
            }
            message(
                NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWRULE,
                if v6 { 10 } else { 2 },
                &nlas,
            )
        })
}

/// A message of a given type with a random attribute tree (the table name set, mostly).
fn framed_message(kind: u16) -> impl Strategy<Value = Vec<u8>> {
    (nla_tree(3), any::<bool>(), any::<bool>(), 0u8..12).prop_map(move |(mut nlas, ours, v6, f)| {
        if ours {
            nlas.insert(0, Nla::Leaf(1, b"nftproxy\0".to_vec()));
            nlas.insert(1, Nla::Leaf(3, b"name\0".to_vec()));
        }
        message(
            NFNL_SUBSYS_NFTABLES << 8 | kind,
            if v6 { 10 } else { f },
            &nlas,
        )
    })
}

fn raw_message() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => vec(any::<u8>(), 0..120),
        1 => (vec(any::<u8>(), 20..120), any::<u16>()).prop_map(|(mut b, kind)| {
            let len = b.len() as u32;
            b[0..4].copy_from_slice(&len.to_ne_bytes());
            b[4..6].copy_from_slice(&kind.to_ne_bytes());
            b
        }),
    ]
}

/// Dumps of generated messages: raw bytes, random attribute trees under valid headers, and
/// rules built from the expressions nftproxy uses with arbitrary attribute values.
#[test]
fn nft_dump_generated() {
    let msgs = |kind: u16| {
        vec(
            prop_oneof![3 => framed_message(kind), 1 => raw_message()],
            0..6,
        )
    };
    fuzz(
        "nft_dump_generated",
        150,
        (
            msgs(NFT_MSG_NEWCHAIN),
            vec(
                prop_oneof![4 => rule_message(), 1 => framed_message(NFT_MSG_NEWRULE), 1 => raw_message()],
                0..10,
            ),
            msgs(NFT_MSG_NEWSET),
            msgs(NFT_MSG_NEWSETELEM),
            element_answer(),
        ),
        |(chains, rules, sets, elements, answer)| {
            let mut dump = Dump {
                chains,
                rules,
                sets,
                elements: BTreeMap::new(),
            };
            // The element dumps of the sets named `name` (and unnamed) answer these.
            dump.elements.insert(String::new(), elements.clone());
            dump.elements.insert("name".into(), elements);
            let table = Table::new(Family::V4);
            for f in Family::ALL {
                if let Ok(Some(state)) = dump.decode(f, answer) {
                    note_state("nft_dump_generated", &state);
                    use_state(&state, &table);
                }
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Netlink replies and notifications.

fn reply_datagram() -> impl Strategy<Value = Vec<u8>> {
    let code = prop_oneof![
        select(vec![0i32, -1, -2, -11, -16, i32::MIN, i32::MAX, 1]),
        any::<i32>()
    ];
    let msg = (
        prop_oneof![
            select(vec![1u16, 2, 3, 0x100, 0xa03, 0xa06, 0xa0f]),
            any::<u16>()
        ],
        any::<u16>(),
        any::<u32>(),
        code,
        vec(any::<u8>(), 0..24),
        prop_oneof![4 => Just(None), 1 => any::<u32>().prop_map(Some)],
    )
        .prop_map(|(kind, flags, seq, code, rest, bad_len)| {
            let mut m = vec![0; NLMSG_HDRLEN];
            m.extend_from_slice(&code.to_ne_bytes());
            m.extend_from_slice(&rest);
            let len = bad_len.unwrap_or(m.len() as u32);
            m[0..4].copy_from_slice(&len.to_ne_bytes());
            m[4..6].copy_from_slice(&kind.to_ne_bytes());
            m[6..8].copy_from_slice(&flags.to_ne_bytes());
            m[8..12].copy_from_slice(&seq.to_ne_bytes());
            m.resize((m.len() + 3) & !3, 0);
            m
        });
    prop_oneof![
        3 => vec(msg, 0..6).prop_map(|ms| ms.concat()),
        1 => vec(any::<u8>(), 0..100),
        1 => (vec(framed_message(NFT_MSG_NEWCHAIN), 0..4), any::<u32>()).prop_map(|(ms, pid)| {
            ms.into_iter()
                .map(|mut m| {
                    m[12..16].copy_from_slice(&pid.to_ne_bytes());
                    m
                })
                .collect::<Vec<_>>()
                .concat()
        }),
    ]
}

/// The reply reader of every request, and the change monitor's filter: never a panic on any
/// datagram, error codes included.
#[test]
fn netlink_replies() {
    fuzz(
        "netlink_replies",
        500,
        (reply_datagram(), any::<u32>()),
        |(datagram, portid)| {
            if let Ok(msgs) = datagram_replies(&datagram) {
                let total: usize = msgs.len() * NLMSG_HDRLEN;
                assert!(total <= datagram.len());
            }
            let _ = foreign_change(&datagram, portid);
            let _ = foreign_change(&datagram, 0);
            let _ = decode_datagram(&datagram);
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Conntrack.

fn addr_pair() -> impl Strategy<Value = (IpAddr, IpAddr)> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<[u8; 4]>()).prop_map(|(a, b)| (IpAddr::from(a), IpAddr::from(b))),
        (any::<[u8; 16]>(), any::<[u8; 16]>())
            .prop_map(|(a, b)| (IpAddr::from(a), IpAddr::from(b))),
    ]
}

fn tuple() -> impl Strategy<Value = Tuple> {
    (
        prop_oneof![select(vec![6u8, 17, 132, 1, 58]), any::<u8>()],
        addr_pair(),
        any::<u16>(),
        any::<u16>(),
    )
        .prop_map(|(proto, (src, dst), src_port, dst_port)| Tuple {
            proto,
            src,
            dst,
            src_port,
            dst_port,
        })
}

fn flow() -> impl Strategy<Value = Flow> {
    (
        tuple(),
        tuple(),
        prop_oneof![Just(0u16), any::<u16>()],
        proptest::option::of(any::<u32>()),
    )
        .prop_map(|(orig, mut reply, zone, id)| {
            // Both directions of one entry are of one family.
            if reply.src.is_ipv4() != orig.src.is_ipv4() {
                reply.src = orig.dst;
                reply.dst = orig.src;
            }
            Flow {
                orig,
                reply,
                zone,
                id,
            }
        })
}

/// A `CT_NEW` message for `f`, as the kernel sends it in a dump.
fn ct_new(f: &Flow, seq: u32) -> Vec<u8> {
    let tuple = |t: &Tuple| {
        vec![
            CtTuple::Ip(vec![
                IPTuple::SourceAddress(t.src),
                IPTuple::DestinationAddress(t.dst),
            ]),
            CtTuple::Proto(vec![
                ProtoTuple::Protocol(Protocol::from(t.proto)),
                ProtoTuple::SourcePort(t.src_port),
                ProtoTuple::DestinationPort(t.dst_port),
            ]),
        ]
    };
    let mut attrs = vec![
        ConntrackAttribute::CtaTupleOrig(tuple(&f.orig)),
        ConntrackAttribute::CtaTupleReply(tuple(&f.reply)),
        ConntrackAttribute::CtaTimeout(30),
    ];
    if let Some(id) = f.id {
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            12,
            id.to_be_bytes().to_vec(),
        )));
    }
    if f.zone != 0 {
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            18,
            f.zone.to_be_bytes().to_vec(),
        )));
    }
    let family = if f.orig.src.is_ipv4() {
        NetfilterProtoFamily::IPv4
    } else {
        NetfilterProtoFamily::IPv6
    };
    let mut nl = NetlinkMessage::from(NetfilterMessage::new(
        NetfilterHeader::new(family, 0, 0),
        ConntrackMessage::New(attrs),
    ));
    nl.header.sequence_number = seq;
    nl.finalize();
    let mut buf = vec![0; nl.buffer_len()];
    nl.serialize(&mut buf);
    buf
}

/// Entries decode to the flows they were built from, and so do they in one datagram.
#[test]
fn conntrack_round_trip() {
    fuzz(
        "conntrack_round_trip",
        200,
        (vec(flow(), 1..6), any::<u32>()),
        |(flows, seq)| {
            let datagram: Vec<u8> = flows
                .iter()
                .map(|f| ct_new(f, seq))
                .collect::<Vec<_>>()
                .concat();
            let decoded = decode_datagram(&datagram).expect("splits");
            assert_eq!(decoded.len(), flows.len());
            for (f, (kind, s, _, got)) in flows.iter().zip(decoded) {
                assert_eq!((kind, s), (1 << 8, seq));
                assert_eq!(got, Some(Ok(*f)));
            }
        },
    );
}

/// Conntrack entries, mutated, and garbage: never a panic; what decodes is judged as the
/// cleanup would judge it.
#[test]
fn conntrack_mutated() {
    fuzz(
        "conntrack_mutated",
        300,
        (
            vec(flow(), 1..4),
            vec((any::<usize>(), mutation()), 0..8),
            prop_oneof![3 => Just(None), 1 => reply_datagram().prop_map(Some)],
        ),
        |(flows, mutations, tail)| {
            let mut dump = Dump {
                rules: flows.iter().map(|f| ct_new(f, 1)).collect(),
                ..Dump::default()
            };
            for (at, m) in &mutations {
                if !matches!(m, Mutation::Misroute(_)) {
                    mutate(&mut dump, *at, m);
                }
            }
            let mut datagram = dump.rules.concat();
            if let Some(t) = tail {
                datagram.extend(t);
            }
            let frontends = Frontends::default();
            if let Ok(msgs) = decode_datagram(&datagram) {
                for (_, _, _, flow) in msgs {
                    if let Some(Ok(f)) = flow {
                        harness::note("conntrack_mutated", "flow_decoded");
                        let _ = is_stale(&f.orig, &f.reply, &frontends, &frontends);
                    }
                }
            }
        },
    );
}

/// The inputs that made the decoders panic before they were fixed (found by the targets
/// above).
#[test]
fn regression_cases() {
    // A tiny client QPS: the rate limiter's wait overflowed `Duration` once the burst was spent.
    let file = KubeProxyConfiguration::parse(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         clientConnection:\n  qps: 1e-30\n",
    )
    .expect("parses");
    let settings = Settings::resolve(&file, &Overrides::default()).expect("resolves");
    exercise_bucket(settings.client.qps, settings.client.burst);

    // An NLMSG_DONE-sized message whose code is i32::MIN: negating it overflowed.
    let mut reply = vec![0u8; 20];
    reply[0] = 20;
    reply[4] = 1;
    reply[16..20].copy_from_slice(&i32::MIN.to_ne_bytes());
    assert!(datagram_replies(&reply).is_ok());
    reply[4] = 2; // NLMSG_ERROR
    assert!(datagram_replies(&reply).is_ok());

    let u32_be = |v: u32| v.to_be_bytes().to_vec();
    let expr = |name: &str, attrs: Vec<Nla>| {
        Nla::Nest(
            1 | NLA_F_NESTED,
            vec![
                Nla::Leaf(1, format!("{name}\0").into_bytes()),
                Nla::Nest(2 | NLA_F_NESTED, attrs),
            ],
        )
    };
    let rule = |exprs: Vec<Nla>| {
        message(
            NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWRULE,
            2,
            &[
                Nla::Leaf(1, b"nftproxy\0".to_vec()),
                Nla::Leaf(2, b"services\0".to_vec()),
                Nla::Nest(4 | NLA_F_NESTED, exprs),
            ],
        )
    };
    let decode = |rule: Vec<u8>| {
        let dump = Dump {
            rules: vec![rule],
            ..Dump::default()
        };
        let _ = dump.decode(Family::V4, ElementAnswer::Empty);
    };
    // A register number near u32::MAX: mapping it to a word overflowed.
    decode(rule(vec![expr(
        "payload",
        vec![
            Nla::Leaf(1, u32_be(u32::MAX - 999)),
            Nla::Leaf(2, u32_be(1)),
            Nla::Leaf(3, u32_be(16)),
            Nla::Leaf(4, u32_be(4)),
        ],
    )]));
    // A set whose name attribute turned into an expression (NFTA_SET_EXPR) holding text: the
    // netlink crate parsed it without checking lengths and panicked.
    let set = message(
        NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWSET,
        2,
        &[
            Nla::Leaf(1, b"nftproxy\0".to_vec()),
            Nla::Leaf(17, b"services\0".to_vec()),
        ],
    );
    let dump = Dump {
        sets: vec![set],
        ..Dump::default()
    };
    let _ = dump.decode(Family::V4, ElementAnswer::Empty);

    // A dnat whose port is not 2 bytes: the port was indexed before the length was checked.
    let value = |v: Vec<u8>| Nla::Nest(2 | NLA_F_NESTED, vec![Nla::Leaf(1, v)]);
    decode(rule(vec![
        expr(
            "immediate",
            vec![Nla::Leaf(1, u32_be(1)), value(vec![10, 0, 0, 1])],
        ),
        expr("immediate", vec![Nla::Leaf(1, u32_be(2)), value(vec![])]),
        expr(
            "nat",
            vec![
                Nla::Leaf(1, u32_be(1)),
                Nla::Leaf(2, u32_be(2)),
                Nla::Leaf(3, u32_be(1)),
                Nla::Leaf(5, u32_be(2)),
            ],
        ),
    ]));
}
