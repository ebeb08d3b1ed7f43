//! Fuzz targets: the kube-proxy configuration, parsed and resolved, and Go durations.

use super::*;

// ---------------------------------------------------------------------------------------------
// The configuration.

pub(super) fn config_string() -> BoxedStrategy<String> {
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

pub(super) fn config_number() -> BoxedStrategy<Value> {
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
pub(super) fn config_string_for(key: &str) -> BoxedStrategy<String> {
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
pub(super) fn config_number_for(key: &str) -> BoxedStrategy<Value> {
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
pub(super) fn config_value(key: &str, schema: &Value) -> BoxedStrategy<Value> {
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
pub(super) fn config_object(schema: &Value) -> BoxedStrategy<Value> {
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

pub(super) fn overrides() -> impl Strategy<Value = Overrides> {
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
pub(super) fn config_text() -> impl Strategy<Value = String> {
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
pub(super) fn exercise_bucket(qps: f32, burst: u32) {
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
pub(super) fn config_parse_and_resolve() {
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
pub(super) fn go_durations() {
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
