//! Generators of Kubernetes objects as JSON values, shaped like what the API server and
//! `kubectl get -o yaml` produce but with every kind of wrongness mixed in: wrong types, missing
//! fields, huge and negative numbers, empty and unicode strings, sloppy and invalid addresses,
//! deep nesting, unknown fields. Plus YAML texts built from them, with random corruption, and
//! YAML's own traps (aliases, merges, tags, deep nesting).
//!
//! Shared by `dataplane/tests/fuzz.rs` and `agent/tests/fuzz.rs`.

#![allow(dead_code)]

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{Map, Value, json};

#[path = "files.rs"]
mod files;
#[path = "valid.rs"]
mod valid;

pub use self::files::*;
pub use self::valid::*;

/// Any JSON value, nested up to `depth` levels.
pub fn any_json(depth: u32) -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter_map("finite", serde_json::Number::from_f64)
            .prop_map(Value::Number),
        weird_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 64, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            vec((weird_string(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

/// A JSON value nested `levels` deep (arrays or objects), far past any sane document.
pub fn deep_json(levels: usize, objects: bool) -> Value {
    // Not `json!`: it serialises a variable it is given, recursively.
    let mut v = Value::from(1);
    for _ in 0..levels {
        v = if objects {
            Value::Object(Map::from_iter([("a".to_string(), v)]))
        } else {
            Value::Array(vec![v])
        };
    }
    v
}

/// Strings that break naive code: empty, whitespace, unicode (multi-byte, combining, RTL,
/// NUL), very long, or things that look like numbers, IPs and YAML.
pub fn weird_string() -> BoxedStrategy<String> {
    prop_oneof![
        3 => select(vec![
            "", " ", "\t", "\n", "None", "null", "~", "0", "-1", "1e309", "NaN", "TCP", "tcp",
            "UDP", "SCTP", "ICMP", "ClusterIP", "NodePort", "LoadBalancer", "ExternalName",
            "Local", "Cluster", "ClientIP", "IPv4", "IPv6", "FQDN", "InternalIP", "ExternalIP",
            "node", "ns", "ns/name", "a.b.c", "é", "日本語", "\u{0}", "\u{feff}", "\u{202e}abc",
            "e\u{301}", "🦀🦀", "::", ":::", "/", "%", "0x10", "---", "- a", "{a: b}", "[1, 2]",
            "*a", "&a", "!!binary", "'", "\"", "\\", "1.2.3.4", "::1", "10.0.0.1/8",
        ])
        .prop_map(str::to_string),
        3 => "[a-zA-Z0-9._/:-]{0,24}",
        2 => any::<String>().prop_map(|s| s.chars().take(40).collect()),
        1 => (select(vec!["a", "é", "🦀", "0", " ", "."]), 200usize..5000)
            .prop_map(|(c, n)| c.repeat(n)),
    ]
    .boxed()
}

/// IP addresses as written in objects: valid ones (often), sloppy ones (leading zeros, spaces),
/// and invalid ones.
pub fn ip_string() -> BoxedStrategy<String> {
    prop_oneof![
        8 => any::<[u8; 4]>().prop_map(|o| std::net::Ipv4Addr::from(o).to_string()),
        12 => (0u8..4, 0u8..4, 0u8..4).prop_map(|(a, b, c)| format!("10.{a}.{b}.{c}")),
        8 => (0u16..4, 0u16..8).prop_map(|(a, b)| format!("fd00:{a}::{b}")),
        3 => any::<[u8; 16]>().prop_map(|o| std::net::Ipv6Addr::from(o).to_string()),
        1 => (0u8..4).prop_map(|a| format!("::ffff:10.0.0.{a}")),
        2 => (0u16..300, 0u16..300, 0u16..300, 0u16..1000)
            .prop_map(|(a, b, c, d)| format!("{a:03}.{b:03}.{c}.{d:04}")),
        1 => select(vec![
            " 10.0.0.1 ", "010.000.000.001", "1.2.3", "1.2.3.4.5", "256.0.0.1", "1..2.3",
            "fe80::1%eth0", "10.0.0.1/32", "::ffff:1.2.3.4", "0.0.0.0", "::", "127.0.0.1",
            "255.255.255.255", "1.2.3.+4", "1.2.3.-4", "1.2.3.04x", "١.٢.٣.٤", "1.2.3.4 ",
            "[::1]", "None", "",
        ])
        .prop_map(str::to_string),
        1 => weird_string(),
    ]
    .boxed()
}

/// CIDRs: valid, with host bits, sloppy, over-long prefixes, garbage.
pub fn cidr_string() -> BoxedStrategy<String> {
    prop_oneof![
        8 => (ip_string(), prop_oneof![4 => 0u16..33, 1 => 0u16..140])
            .prop_map(|(ip, len)| format!("{ip}/{len}")),
        1 => select(vec![
            "10.0.0.0/8", "fd00::/64", "0.0.0.0/0", "::/0", "10.0.0.0/", "/8", "10.0.0.0/-1",
            "10.0.0.0/08", "10.0.0.0/ 8", "10.0.0.0/8/9", "10.0.0.0//8", "10.0.0.0/4294967296",
        ])
        .prop_map(str::to_string),
        1 => weird_string(),
    ]
    .boxed()
}

/// A JSON number for a port-like field: in range, at its edges, far out of range, or not an
/// integer at all.
pub fn int_value() -> BoxedStrategy<Value> {
    prop_oneof![
        300 => (1i64..65536).prop_map(Value::from),
        30 => (1i64..86401).prop_map(Value::from),
        30 => select(vec![
            0i64, -1, 1, 65535, 65536, 86400, 86401, 2147483647, -2147483648,
        ])
        .prop_map(Value::from),
        // Not an i32: the whole object fails to deserialise.
        1 => select(vec![
            json!(2147483648i64), json!(-2147483649i64), json!(i64::MIN), json!(i64::MAX),
            json!(u64::MAX), json!(80.5), json!("80"),
        ]),
        1 => any_json(1),
    ]
    .boxed()
}

/// `good` almost always, else a value of any type: one wrong type anywhere makes a whole
/// object fail to deserialise, so wrongness is mostly left to [`json_edits`].
pub fn mostly(good: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
    prop_oneof![1000 => good, 1 => any_json(2)].boxed()
}

fn string_value(s: BoxedStrategy<String>) -> BoxedStrategy<Value> {
    mostly(s.prop_map(Value::String).boxed())
}

fn pick(values: &[&'static str]) -> BoxedStrategy<Value> {
    let values: Vec<&'static str> = values.to_vec();
    mostly(
        prop_oneof![
            25 => select(values).prop_map(Value::from),
            1 => select(vec!["", "bogus"]).prop_map(Value::from),
        ]
        .boxed(),
    )
}

fn list(item: BoxedStrategy<Value>, max: usize) -> BoxedStrategy<Value> {
    mostly(vec(item, 0..max).prop_map(Value::Array).boxed())
}

/// How often a field is present: required ones almost always, a deletion rarely.
fn presence(key: &str) -> f64 {
    match key {
        "apiVersion" | "kind" | "metadata" | "name" | "spec" | "addressType" | "port"
        | "clusterIP" | "addresses" | "labels" => 0.97,
        "deletionTimestamp" => 0.1,
        _ => 0.8,
    }
}

/// An object whose fields each appear with their [`presence`], plus a few unknown ones.
pub fn object(fields: Vec<(&'static str, BoxedStrategy<Value>)>) -> BoxedStrategy<Value> {
    let fields: Vec<BoxedStrategy<Option<(String, Value)>>> = fields
        .into_iter()
        .map(|(k, s)| {
            proptest::option::weighted(presence(k), s.prop_map(move |v| (k.to_string(), v))).boxed()
        })
        .collect();
    let extra = vec(("[a-zA-Z]{1,8}", any_json(1)), 0..2);
    mostly(
        (fields, extra)
            .prop_map(|(fields, extra)| {
                let mut m = Map::new();
                for (k, v) in extra.into_iter().chain(fields.into_iter().flatten()) {
                    m.insert(k, v);
                }
                Value::Object(m)
            })
            .boxed(),
    )
}

fn name() -> BoxedStrategy<Value> {
    string_value(
        prop_oneof![
            6 => "[a-z][a-z0-9-]{0,6}",
            1 => weird_string(),
        ]
        .boxed(),
    )
}

/// Labels: mostly the ones the proxy reads (`service_name` decides whether a slice names its
/// Service), sometimes others.
fn labels(service_name: f64) -> BoxedStrategy<Value> {
    let key = prop_oneof![
        4 => select(vec![
            "service.kubernetes.io/service-proxy-name",
            "service.kubernetes.io/headless",
            "topology.kubernetes.io/zone",
            "kubernetes.io/hostname",
            "app",
        ])
        .prop_map(str::to_string),
        1 => weird_string(),
    ];
    let value = || {
        prop_oneof![
            40 => select(vec!["web", "db", "other", "", "zone-a", "node"]).prop_map(Value::from),
            1 => any_json(1),
        ]
    };
    let others = prop_oneof![3 => Just(Vec::new()), 1 => vec((key, value()), 1..3)];
    mostly(
        (others, proptest::option::weighted(service_name, value()))
            .prop_map(|(kv, name)| {
                let mut m: Map<String, Value> = kv.into_iter().collect();
                if let Some(n) = name {
                    m.insert("kubernetes.io/service-name".into(), n);
                }
                Value::Object(m)
            })
            .boxed(),
    )
}

fn metadata(service_name: f64) -> BoxedStrategy<Value> {
    object(vec![
        ("name", name()),
        ("namespace", name()),
        ("labels", labels(service_name)),
        (
            "annotations",
            mostly(
                vec(
                    (
                        Just("endpoints.kubernetes.io/last-change-trigger-time".to_string()),
                        weird_string().prop_map(Value::String),
                    ),
                    0..2,
                )
                .prop_map(|kv| Value::Object(kv.into_iter().collect()))
                .boxed(),
            ),
        ),
        (
            "deletionTimestamp",
            string_value(
                prop_oneof![
                    10 => Just("2024-01-01T00:00:00Z"),
                    1 => select(vec!["yesterday", ""]),
                ]
                .prop_map(str::to_string)
                .boxed(),
            ),
        ),
        ("resourceVersion", string_value("[0-9]{0,6}".boxed())),
        ("uid", string_value(weird_string())),
    ])
}

fn protocol() -> BoxedStrategy<Value> {
    pick(&["TCP", "TCP", "TCP", "UDP", "UDP", "SCTP"])
}

/// `spec.clusterIPs`: one address, a dual-stack pair (either order), or any list.
fn cluster_ips() -> BoxedStrategy<Value> {
    let v4 = || (0u8..8).prop_map(|a| format!("172.30.0.{a}"));
    let v6 = || (0u16..8).prop_map(|a| format!("fd00:30::{a:x}"));
    prop_oneof![
        3 => v4().prop_map(|a| json!([a])),
        1 => v6().prop_map(|a| json!([a])),
        2 => (v4(), v6()).prop_map(|(a, b)| json!([a, b])),
        1 => (v6(), v4()).prop_map(|(a, b)| json!([a, b])),
        1 => list(string_value(ip_string()), 3),
    ]
    .boxed()
}

fn service_port() -> BoxedStrategy<Value> {
    object(vec![
        ("name", name()),
        ("protocol", protocol()),
        ("port", int_value()),
        ("nodePort", int_value()),
        ("targetPort", prop_oneof![int_value(), name()].boxed()),
        ("appProtocol", name()),
    ])
}

/// A v1 Service.
pub fn service() -> BoxedStrategy<Value> {
    let spec = object(vec![
        (
            "type",
            pick(&[
                "ClusterIP",
                "ClusterIP",
                "ClusterIP",
                "NodePort",
                "NodePort",
                "LoadBalancer",
                "LoadBalancer",
                "ExternalName",
            ]),
        ),
        ("clusterIP", string_value(ip_string())),
        ("clusterIPs", cluster_ips()),
        ("externalIPs", list(string_value(ip_string()), 3)),
        ("ports", list(service_port(), 5)),
        ("externalTrafficPolicy", pick(&["Local", "Cluster"])),
        ("internalTrafficPolicy", pick(&["Local", "Cluster"])),
        ("healthCheckNodePort", int_value()),
        ("sessionAffinity", pick(&["None", "ClientIP"])),
        (
            "sessionAffinityConfig",
            object(vec![(
                "clientIP",
                object(vec![("timeoutSeconds", int_value())]),
            )]),
        ),
        (
            "loadBalancerSourceRanges",
            list(string_value(cidr_string()), 3),
        ),
        ("ipFamilies", list(pick(&["IPv4", "IPv6"]), 3)),
        (
            "ipFamilyPolicy",
            pick(&["SingleStack", "PreferDualStack", "RequireDualStack"]),
        ),
        ("externalName", name()),
        ("selector", labels(0.05)),
    ]);
    let status = object(vec![(
        "loadBalancer",
        object(vec![(
            "ingress",
            list(
                object(vec![
                    ("ip", string_value(ip_string())),
                    ("ipMode", pick(&["VIP", "Proxy"])),
                    ("hostname", name()),
                ]),
                3,
            ),
        )]),
    )]);
    typed(
        "v1",
        "Service",
        vec![
            ("metadata", metadata(0.05)),
            ("spec", spec),
            ("status", status),
        ],
    )
}

/// A discovery.k8s.io/v1 EndpointSlice.
pub fn endpoint_slice() -> BoxedStrategy<Value> {
    prop_oneof![
        8 => Just("IPv4"),
        6 => Just("IPv6"),
        2 => Just("FQDN"),
        1 => select(vec!["", "bogus", "ipv4"]),
    ]
    .prop_flat_map(endpoint_slice_of)
    .boxed()
}

/// An address of the family `address_type` names, almost always.
fn address_of(address_type: &str) -> BoxedStrategy<String> {
    let v6 = address_type == "IPv6";
    let matching = (0u16..4, 0u16..4, 1u16..250).prop_map(move |(a, b, c)| {
        if v6 {
            format!("fd00:{a:x}:{b:x}::{c:x}")
        } else {
            format!("10.{a}.{b}.{c}")
        }
    });
    prop_oneof![30 => matching, 1 => ip_string()].boxed()
}

fn endpoint_slice_of(address_type: &'static str) -> BoxedStrategy<Value> {
    let endpoint = object(vec![
        ("addresses", list(string_value(address_of(address_type)), 3)),
        (
            "conditions",
            object(vec![
                ("ready", mostly(any::<bool>().prop_map(Value::Bool).boxed())),
                (
                    "serving",
                    mostly(any::<bool>().prop_map(Value::Bool).boxed()),
                ),
                (
                    "terminating",
                    mostly(any::<bool>().prop_map(Value::Bool).boxed()),
                ),
            ]),
        ),
        ("nodeName", pick(&["node", "other-node", "Node"])),
        ("zone", pick(&["zone-a", "zone-b"])),
        (
            "hints",
            object(vec![
                (
                    "forZones",
                    list(object(vec![("name", pick(&["zone-a", "zone-b"]))]), 3),
                ),
                (
                    "forNodes",
                    list(object(vec![("name", pick(&["node", "other-node"]))]), 3),
                ),
            ]),
        ),
        (
            "targetRef",
            object(vec![
                ("kind", pick(&["Pod"])),
                ("name", name()),
                ("namespace", name()),
            ]),
        ),
    ]);
    let port = object(vec![
        ("name", name()),
        ("protocol", protocol()),
        ("port", int_value()),
        ("appProtocol", name()),
    ]);
    typed(
        "discovery.k8s.io/v1",
        "EndpointSlice",
        vec![
            ("metadata", metadata(0.95)),
            ("addressType", Just(Value::from(address_type)).boxed()),
            ("ports", list(port, 4)),
            ("endpoints", list(endpoint, 24)),
        ],
    )
}

/// A v1 Node (often the one the tests run as: `node`).
pub fn node() -> BoxedStrategy<Value> {
    let meta = (metadata(0.05), prop::bool::weighted(0.7)).prop_map(|(mut m, ours)| {
        if ours && let Value::Object(o) = &mut m {
            o.insert("name".into(), json!("node"));
        }
        m
    });
    let spec = object(vec![
        ("podCIDR", string_value(cidr_string())),
        ("podCIDRs", list(string_value(cidr_string()), 3)),
        (
            "taints",
            list(
                object(vec![
                    (
                        "key",
                        pick(&[
                            "ToBeDeletedByClusterAutoscaler",
                            "node.kubernetes.io/unschedulable",
                        ]),
                    ),
                    ("effect", pick(&["NoSchedule", "NoExecute"])),
                    ("value", name()),
                ]),
                3,
            ),
        ),
        (
            "unschedulable",
            mostly(any::<bool>().prop_map(Value::Bool).boxed()),
        ),
    ]);
    let status = object(vec![(
        "addresses",
        list(
            object(vec![
                ("type", pick(&["InternalIP", "ExternalIP", "Hostname"])),
                ("address", string_value(ip_string())),
            ]),
            4,
        ),
    )]);
    typed(
        "v1",
        "Node",
        vec![
            ("metadata", meta.boxed()),
            ("spec", spec),
            ("status", status),
        ],
    )
}

/// A networking.k8s.io/v1 ServiceCIDR.
pub fn service_cidr() -> BoxedStrategy<Value> {
    typed(
        "networking.k8s.io/v1",
        "ServiceCIDR",
        vec![
            ("metadata", metadata(0.05)),
            (
                "spec",
                object(vec![("cidrs", list(string_value(cidr_string()), 3))]),
            ),
        ],
    )
}

/// An object with `apiVersion` and `kind` (usually right, sometimes not) and `fields`.
fn typed(
    api_version: &'static str,
    kind: &'static str,
    fields: Vec<(&'static str, BoxedStrategy<Value>)>,
) -> BoxedStrategy<Value> {
    let mut all = vec![
        ("apiVersion", Just(Value::from(api_version)).boxed()),
        ("kind", Just(Value::from(kind)).boxed()),
    ];
    all.extend(fields);
    let edits = prop_oneof![3 => Just(Vec::new()), 1 => vec(json_edit(), 1..4)];
    (object(all), edits)
        .prop_map(move |(mut v, edits)| {
            apply_json_edits(&mut v, &edits);
            // The kind decides the type the object is read as: keep it mostly.
            if let Value::Object(m) = &mut v
                && !m.get("kind").is_some_and(Value::is_string)
            {
                m.insert("kind".into(), kind.into());
            }
            v
        })
        .boxed()
}

/// One change to a JSON tree: the `n`th node (depth first, modulo their number) replaced,
/// removed, or given a new key.
#[derive(Clone, Debug)]
pub enum JsonEdit {
    Replace(usize, Value),
    Remove(usize),
    Insert(usize, String, Value),
}

pub fn json_edit() -> BoxedStrategy<JsonEdit> {
    let value = prop_oneof![
        3 => any_json(2),
        2 => int_value(),
        2 => weird_string().prop_map(Value::String),
        1 => ip_string().prop_map(Value::String),
    ];
    prop_oneof![
        4 => (any::<usize>(), value.clone()).prop_map(|(n, v)| JsonEdit::Replace(n, v)),
        2 => any::<usize>().prop_map(JsonEdit::Remove),
        1 => (any::<usize>(), weird_string(), value).prop_map(|(n, k, v)| JsonEdit::Insert(n, k, v)),
    ]
    .boxed()
}

fn json_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(json_nodes).sum(),
        Value::Object(m) => m.values().map(json_nodes).sum(),
        _ => 0,
    }
}

/// Applies `f` to the `n`th node below `v` (depth first), with its parent's key or index.
fn nth_json(v: &mut Value, n: &mut usize, f: &mut dyn FnMut(&mut Value, Option<usize>)) -> bool {
    let len = match v {
        Value::Array(a) => a.len(),
        Value::Object(m) => m.len(),
        _ => 0,
    };
    for i in 0..len {
        if *n == 0 {
            f(v, Some(i));
            return true;
        }
        *n -= 1;
        let child = match v {
            Value::Array(a) => &mut a[i],
            Value::Object(m) => m.values_mut().nth(i).expect("in range"),
            _ => unreachable!(),
        };
        if nth_json(child, n, f) {
            return true;
        }
    }
    false
}

/// What an edit does to the parent of the node it picked (with the node's index in it).
type NodeEdit = Box<dyn FnMut(&mut Value, Option<usize>)>;

pub fn apply_json_edits(v: &mut Value, edits: &[JsonEdit]) {
    for e in edits {
        let total = json_nodes(v).saturating_sub(1).max(1);
        let (n, f): (usize, NodeEdit) = match e.clone() {
            JsonEdit::Replace(n, new) => (
                n,
                Box::new(move |parent, i| match (parent, i) {
                    (Value::Array(a), Some(i)) => a[i] = new.clone(),
                    (Value::Object(m), Some(i)) => {
                        if let Some(x) = m.values_mut().nth(i) {
                            *x = new.clone();
                        }
                    }
                    _ => {}
                }),
            ),
            JsonEdit::Remove(n) => (
                n,
                Box::new(|parent, i| match (parent, i) {
                    (Value::Array(a), Some(i)) => {
                        a.remove(i);
                    }
                    (Value::Object(m), Some(i)) => {
                        if let Some(k) = m.keys().nth(i).cloned() {
                            m.remove(&k);
                        }
                    }
                    _ => {}
                }),
            ),
            JsonEdit::Insert(n, key, new) => (
                n,
                Box::new(move |parent, _| match parent {
                    Value::Array(a) => a.push(new.clone()),
                    Value::Object(m) => {
                        m.insert(key.clone(), new.clone());
                    }
                    _ => {}
                }),
            ),
        };
        let mut f = f;
        let mut n = n % total;
        nth_json(v, &mut n, &mut *f);
    }
}

/// Any of the four kinds nftproxy reads.
pub fn any_object() -> BoxedStrategy<Value> {
    prop_oneof![
        3 => service(),
        3 => endpoint_slice(),
        1 => node(),
        1 => service_cidr(),
        1 => any_json(3),
    ]
    .boxed()
}
