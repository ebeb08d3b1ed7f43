//! Fuzzing of everything the pure core reads from outside: Kubernetes objects (as the API server
//! or a YAML file gives them) through conversion, the tracker and the builders, YAML files, and
//! `iptables-save` output. Each target asserts that nothing panics, that every call returns
//! within the time limit, and where there is one, a round trip.
//!
//! Cases per target: `NFTPROXY_FUZZ_CASES` (small by default); see `fuzz/harness.rs` and
//! `scripts/fuzz.sh` for long runs.

#[path = "fuzz/harness.rs"]
mod harness;
#[path = "fuzz/k8s.rs"]
mod k8s;

use std::collections::{BTreeMap, BTreeSet};

use harness::fuzz;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use nftproxy_dataplane::convert;
use nftproxy_dataplane::input::Object;
use nftproxy_dataplane::iptables::{
    self, Existing, IptablesOptions, PREFIX, jump_target, parse_save, plan_full, plan_removal,
    tokens,
};
use nftproxy_dataplane::model::{Cluster, ObjectName, Shared};
use nftproxy_dataplane::nft::build::{BuildConfig, LocalDetector, NodePortAddresses, build};
use nftproxy_dataplane::nft::desired::Desired;
use nftproxy_dataplane::nft::render;
use nftproxy_dataplane::nft::ruleset::Family;
use nftproxy_dataplane::tracker::{Kind, Tracker};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Kubernetes objects, one at a time.

fn proxy_name() -> impl Strategy<Value = String> {
    prop_oneof![4 => Just(String::new()), 1 => Just("other".to_string())]
}

#[test]
fn convert_service() {
    fuzz(
        "convert_service",
        150,
        (k8s::service(), proxy_name()),
        |(json, proxy)| {
            let Ok(svc) = serde_json::from_value::<core::Service>(json) else {
                return;
            };
            harness::note("convert_service", "deserialized");
            let name = convert::object_name(&svc.metadata);
            let Ok(s) = convert::service(&svc, name, &mut Shared::default(), &proxy) else {
                return;
            };
            harness::note("convert_service", "converted");
            assert!(!s.name.name.is_empty());
            assert!(!s.cluster_ips.is_empty() && s.cluster_ips.len() <= 2);
            if let [a, b] = &*s.cluster_ips {
                assert_ne!(Family::of(a), Family::of(b), "two ClusterIPs of one family");
            }
            for p in s.ports.iter() {
                assert_ne!(p.port, 0);
                assert_ne!(p.node_port, Some(0));
            }
            if let Some(t) = s.affinity_timeout {
                assert!((1..=86400).contains(&t));
            }
        },
    );
}

#[test]
fn convert_endpoint_slice() {
    fuzz(
        "convert_endpoint_slice",
        100,
        (k8s::endpoint_slice(), proxy_name()),
        |(json, proxy)| {
            let Ok(slice) = serde_json::from_value::<discovery::EndpointSlice>(json) else {
                return;
            };
            harness::note("convert_endpoint_slice", "deserialized");
            let mut shared = Shared::default();
            let Ok(s) = convert::endpoint_slice(
                &slice,
                convert::object_name(&slice.metadata),
                &mut shared,
                &proxy,
            ) else {
                return;
            };
            harness::note("convert_endpoint_slice", "converted");
            for e in &s.endpoints {
                assert_eq!(Family::of(&e.addr), s.family);
            }
            for p in s.ports.iter() {
                assert_ne!(p.port, 0);
            }
        },
    );
}

#[test]
fn convert_node() {
    fuzz("convert_node", 200, k8s::node(), |json| {
        let Ok(node) = serde_json::from_value::<core::Node>(json) else {
            return;
        };
        harness::note("convert_node", "deserialized");
        if let Ok(n) = convert::node(&node) {
            harness::note("convert_node", "converted");
            assert!(!n.name.is_empty());
            for net in &n.pod_cidrs {
                assert_eq!(net.trunc(), *net, "host bits left in {net}");
            }
        }
    });
}

#[test]
fn convert_service_cidr() {
    fuzz("convert_service_cidr", 150, k8s::service_cidr(), |json| {
        let Ok(cidr) = serde_json::from_value::<networking::ServiceCIDR>(json) else {
            return;
        };
        harness::note("convert_service_cidr", "deserialized");
        if let Ok((_, nets)) = convert::service_cidr(&cidr) {
            harness::note("convert_service_cidr", "converted");
            for net in &nets {
                assert_eq!(net.trunc(), *net, "host bits left in {net}");
            }
        }
    });
}

/// Addresses and CIDRs as text: sloppy parsing never panics, and what it accepts prints back
/// as something it accepts again, unchanged.
#[test]
fn sloppy_ip_and_cidr_parsing() {
    fuzz(
        "sloppy_ip_and_cidr_parsing",
        1000,
        prop_oneof![k8s::ip_string(), k8s::cidr_string(), any::<String>()],
        |text| {
            if let Some(ip) = convert::parse_ip_sloppy(&text) {
                assert_eq!(convert::parse_ip_sloppy(&ip.to_string()), Some(ip));
            }
            if let Some(net) = convert::parse_cidr_sloppy(&text) {
                assert_eq!(convert::parse_cidr_sloppy(&net.to_string()), Some(net));
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Whole files and the builders behind them.

fn build_config() -> impl Strategy<Value = BuildConfig> {
    let net = |s: &str| s.parse().unwrap();
    let detector = prop_oneof![
        Just(LocalDetector::None),
        Just(LocalDetector::ClusterCidr(vec![net("10.0.0.0/8")])),
        Just(LocalDetector::ClusterCidr(vec![
            net("10.0.0.0/8"),
            net("fd00::/8")
        ])),
        Just(LocalDetector::NodeCidr),
        Just(LocalDetector::BridgeInterface("cbr0".into())),
        Just(LocalDetector::InterfaceNamePrefix("veth".into())),
    ];
    let node_ports = prop_oneof![
        Just(NodePortAddresses::Primary),
        Just(NodePortAddresses::Cidrs(vec![])),
        Just(NodePortAddresses::Cidrs(vec![
            net("0.0.0.0/0"),
            net("::/0")
        ])),
        Just(NodePortAddresses::Cidrs(vec![
            net("127.0.0.0/8"),
            net("10.0.0.0/16")
        ])),
    ];
    (detector, node_ports, any::<bool>(), 0u32..32).prop_map(
        move |(local_detector, node_port_addresses, masquerade_all, masquerade_bit)| BuildConfig {
            node_name: "node".into(),
            masquerade_all,
            masquerade_bit,
            local_detector,
            node_port_addresses,
            local_addresses: vec![
                "10.0.0.1".parse().unwrap(),
                "127.0.0.1".parse().unwrap(),
                "fd00::1".parse().unwrap(),
            ],
        },
    )
}

/// Builds, renders and plans everything `cluster` leads to, in both modes and families.
fn build_everything(cluster: &Cluster, config: &BuildConfig) {
    for family in Family::ALL {
        let built = build(cluster, config, family);
        let _ = render::table_text(&built.table);
        let tx = nftproxy_dataplane::nft::plan::plan(
            None,
            &nftproxy_dataplane::nft::desired::Before::Nothing,
            &built.table,
        );
        let _ = render::transaction_text(&tx);
        let ipt = iptables::build(cluster, config, &IptablesOptions::default(), family);
        let restore = plan_full(&ipt, &Existing::default());
        // What a full restore writes reads back as the same chains and rules.
        let saved = parse_save(&restore.text);
        for (table, chains) in &ipt.tables {
            let t = &saved[table.name()];
            for (name, chain) in chains {
                assert!(t.chains.contains(name), "chain {name} missing");
                let rules: Vec<&String> = t
                    .rules
                    .iter()
                    .filter(|(c, _)| c == name)
                    .map(|(_, r)| r)
                    .collect();
                assert_eq!(rules, chain.rules.iter().collect::<Vec<_>>(), "{name}");
            }
        }
    }
}

#[test]
fn yaml_file_to_rules() {
    fuzz(
        "yaml_file_to_rules",
        30,
        (k8s::yaml_file(12), proxy_name(), build_config()),
        |(file, proxy, config)| {
            let text = file.text();
            let Ok((objects, _skipped)) = nftproxy_dataplane::input::parse_yaml(&text) else {
                return;
            };
            harness::note("yaml_file_to_rules", "parsed");
            let (cluster, _) = convert::cluster(&objects, "node", &proxy);
            if !cluster.services.is_empty() {
                harness::note("yaml_file_to_rules", "with_services");
            }
            build_everything(&cluster, &config);
        },
    );
}

/// Valid clusters (every Service feature, many endpoints) through the same path.
#[test]
fn valid_cluster_to_rules() {
    fuzz(
        "valid_cluster_to_rules",
        20,
        (k8s::valid_cluster(10), build_config()),
        |(cluster, config)| {
            let (objects, skipped) =
                nftproxy_dataplane::input::parse_yaml(&cluster.yaml()).expect("valid YAML");
            assert!(skipped.is_empty(), "{skipped:?}");
            let (model, skipped) = convert::cluster(&objects, "node", "");
            assert!(skipped.is_empty(), "valid objects skipped: {skipped:?}");
            assert_eq!(model.services.len(), cluster.services.len());
            build_everything(&model, &config);
        },
    );
}

#[test]
fn yaml_traps() {
    fuzz("yaml_traps", 100, k8s::yaml_trap(), |text| {
        let mut seen = 0usize;
        let mut skipped = Vec::new();
        let _ = nftproxy_dataplane::input::for_each_object(&text, &mut skipped, |_| seen += 1);
        if let Ok((objects, _)) = nftproxy_dataplane::input::parse_yaml(&text) {
            let (cluster, _) = convert::cluster(&objects, "node", "");
            build_everything(&cluster, &BuildConfig::default());
        }
    });
}

/// Nesting beyond the parsers' recursion limits, as flow collections and as JSON. The YAML
/// scanner (unsafe-libyaml, under serde_yaml_ng) takes time quadratic in the depth of nested
/// flow mappings before the recursion limit is checked (`{a: ` × 20 000, 100 kB: about 1 s in a
/// release build, 5 s in a debug one), so the depth here stays where a case fits the limit.
#[test]
fn yaml_deep_nesting() {
    fuzz(
        "yaml_deep_nesting",
        6,
        (100usize..3_000, any::<bool>(), any::<bool>()),
        |(levels, objects, as_json)| {
            let value = k8s::deep_json(levels, objects);
            let text = if as_json {
                // serde_json's own printer recurses; build the text by hand.
                let (open, close) = if objects {
                    ("{\"a\":", "}")
                } else {
                    ("[", "]")
                };
                format!("{}1{}", open.repeat(levels), close.repeat(levels))
            } else {
                let (open, close) = if objects { ("{a: ", "}") } else { ("[", "]") };
                format!("{}1{}", open.repeat(levels), close.repeat(levels))
            };
            let _ = nftproxy_dataplane::input::parse_yaml(&text);
            let wrapped = format!("kind: Service\nmetadata: {{name: x}}\nspec: {text}\n");
            let _ = nftproxy_dataplane::input::parse_yaml(&wrapped);
            // A deep value handed over by a client (the API server path) must not overflow
            // the stack when it is converted or dropped either.
            if levels <= 120 {
                let _ = serde_json::from_value::<core::Service>(
                    serde_json::json!({"metadata": {"name": "x"}, "spec": value}),
                );
            } else {
                std::mem::forget(value);
            }
        },
    );
}

#[test]
fn yaml_raw_bytes() {
    fuzz(
        "yaml_raw_bytes",
        300,
        prop_oneof![
            vec(any::<u8>(), 0..512).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
            any::<String>(),
            "[-:{}\\[\\],&*!|>'\"%@`# \n\ta-z0-9]{0,300}",
        ],
        |text| {
            if let Ok((objects, _)) = nftproxy_dataplane::input::parse_yaml(&text) {
                let (cluster, _) = convert::cluster(&objects, "node", "");
                build_everything(&cluster, &BuildConfig::default());
            }
        },
    );
}

/// Watch events as the API server would send them (adds, updates, deletes, re-lists), through
/// the tracker and incremental builds: the same tables' chains as a full build of the result.
#[derive(Clone, Debug)]
enum Event {
    Apply(Value),
    Delete(u8, usize),
    Relist(u8),
    Sync,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        8 => k8s::any_object().prop_map(Event::Apply),
        2 => (0u8..4, any::<usize>()).prop_map(|(k, i)| Event::Delete(k, i)),
        1 => (0u8..4).prop_map(Event::Relist),
        2 => Just(Event::Sync),
    ]
}

fn kind_of(k: u8) -> Kind {
    Kind::ALL[usize::from(k) % Kind::ALL.len()]
}

fn apply(tracker: &mut Tracker, json: Value) {
    let mut skipped = Vec::new();
    // As the watchers deserialise: the object's own kind decides its type.
    let text = serde_json::to_string(&json).unwrap_or_default();
    let _ = nftproxy_dataplane::input::for_each_object(&text, &mut skipped, |o| {
        let _ = match &o {
            Object::Service(s) => tracker.apply_service(s),
            Object::Slice(s) => tracker.apply_slice(s),
            Object::Node(n) => tracker.apply_node(n),
            Object::ServiceCidr(c) => tracker.apply_service_cidr(c),
        };
    });
}

fn names_of(tracker: &Tracker, kind: Kind) -> Vec<ObjectName> {
    let c = tracker.cluster();
    match kind {
        Kind::Service => c.services.keys().cloned().collect(),
        Kind::EndpointSlice => c.slices.keys().cloned().collect(),
        Kind::Node => c
            .node
            .iter()
            .map(|n| ObjectName::new("", &n.name))
            .collect(),
        Kind::ServiceCidr => c
            .service_cidrs
            .keys()
            .map(|n| ObjectName::new("", n))
            .collect(),
    }
}

#[test]
fn tracker_events() {
    fuzz(
        "tracker_events",
        15,
        (vec(event(), 0..40), build_config()),
        |(events, config)| {
            let mut tracker = Tracker::new("node", "");
            for kind in Kind::ALL {
                tracker.begin_list(kind);
                tracker.end_list(kind);
            }
            let mut desired: Vec<Desired> = Family::ALL
                .iter()
                .map(|f| Desired::build(tracker.cluster(), &config, *f))
                .collect();
            let sync = |tracker: &mut Tracker, desired: &mut Vec<Desired>| {
                let changes = tracker.take_changes();
                for d in desired.iter_mut() {
                    if changes.all {
                        *d = Desired::build(tracker.cluster(), &config, d.family());
                    } else {
                        d.update(tracker.cluster(), &config, &changes.services);
                    }
                }
            };
            for e in events {
                match e {
                    Event::Apply(json) => apply(&mut tracker, json),
                    Event::Delete(k, i) => {
                        let kind = kind_of(k);
                        let names = names_of(&tracker, kind);
                        if !names.is_empty() {
                            tracker.delete(kind, &names[i % names.len()]);
                        }
                    }
                    Event::Relist(k) => {
                        let kind = kind_of(k);
                        tracker.begin_list(kind);
                        tracker.end_list(kind);
                    }
                    Event::Sync => sync(&mut tracker, &mut desired),
                }
            }
            sync(&mut tracker, &mut desired);
            for d in &desired {
                let full = build(tracker.cluster(), &config, d.family());
                let chains = |t: &nftproxy_dataplane::nft::ruleset::Table| {
                    t.chains.keys().cloned().collect::<BTreeSet<_>>()
                };
                assert_eq!(chains(d.table()), chains(&full.table), "{:?}", d.family());
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// iptables-save output.

/// One argument of a rule, as iptables-save quotes it.
fn quote(arg: &str) -> String {
    if !arg.is_empty() && !arg.contains(|c: char| c.is_whitespace() || c == '"' || c == '\\') {
        return arg.to_string();
    }
    let mut out = String::from("\"");
    for c in arg.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

#[derive(Clone, Debug)]
struct SaveTable {
    name: String,
    /// Name and policy (`None`: a user chain, written `-`).
    chains: Vec<(String, Option<String>)>,
    rules: Vec<SaveRule>,
}

/// A rule: its chain (an index into `chains`), arguments, and target (`-g`?, index).
type SaveRule = (usize, Vec<String>, Option<(bool, usize)>);

impl SaveTable {
    fn spec(&self, args: &[String], target: &Option<(bool, usize)>) -> (String, Vec<String>) {
        let mut all = args.to_vec();
        if let Some((goto, t)) = target {
            all.push(if *goto { "-g" } else { "-j" }.to_string());
            all.push(self.chains[t % self.chains.len()].0.clone());
        }
        let text = all.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" ");
        (text, all)
    }

    fn text(&self) -> String {
        let mut s = format!(
            "# Generated by iptables-save v1.8.9 on today\n*{}\n",
            self.name
        );
        for (c, policy) in &self.chains {
            s.push_str(&format!(
                ":{c} {} [0:0]\n",
                policy.as_deref().unwrap_or("-")
            ));
        }
        for (chain, args, target) in &self.rules {
            let (spec, _) = self.spec(args, target);
            s.push_str(&format!(
                "-A {} {spec}\n",
                self.chains[chain % self.chains.len()].0
            ));
        }
        s.push_str("COMMIT\n# Completed on today\n");
        s
    }
}

fn chain_name() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec![
            "PREROUTING",
            "INPUT",
            "FORWARD",
            "OUTPUT",
            "POSTROUTING",
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-FIREWALL",
            "NFTPROXY-SERVICES",
            "NFTPROXY-POSTROUTING",
            "cali-INPUT",
            "DOCKER",
        ])
        .prop_map(str::to_string),
        "(KUBE|NFTPROXY)-(SVC|SEP|EXT|FW|XLB)-[A-Z0-9]{4,16}",
        "[A-Za-z0-9_.-]{1,28}",
    ]
}

fn rule_arg() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec![
            "-m",
            "comment",
            "--comment",
            "-p",
            "tcp",
            "udp",
            "--dport",
            "80",
            "-s",
            "-d",
            "10.0.0.0/8",
            "!",
            "-i",
            "eth+",
            "--to-destination",
            "10.1.2.3:8080",
            "DNAT",
            "RETURN",
            "ACCEPT",
            "DROP",
            "MARK",
            "--set-xmark",
            "0x4000/0x4000",
            "statistic",
            "--mode",
            "random",
            "--probability",
            "0.50000000000",
            "-j",
            "-g",
            "--jump",
        ])
        .prop_map(str::to_string),
        "[a-zA-Z0-9/:.,=_+-]{1,12}",
        // Comments with spaces, quotes and backslashes.
        "[a-z \"\\\\/:._-]{0,24}",
        any::<String>().prop_map(|s| s
            .chars()
            .filter(|c| *c != '\n' && *c != '\r')
            .take(16)
            .collect()),
    ]
}

fn save_table() -> impl Strategy<Value = SaveTable> {
    let name = prop_oneof![
        4 => select(vec!["filter", "nat", "mangle", "raw", "security"]).prop_map(str::to_string),
        1 => "[a-z0-9_-]{1,10}",
    ];
    let chains = vec(
        (
            chain_name(),
            proptest::option::of(select(vec!["ACCEPT", "DROP"]).prop_map(str::to_string)),
        ),
        1..12,
    );
    let rules = vec(
        (
            any::<usize>(),
            vec(rule_arg(), 0..8),
            proptest::option::weighted(0.8, (any::<bool>(), any::<usize>())),
        ),
        0..30,
    );
    (name, chains, rules).prop_map(|(name, mut chains, rules)| {
        // Chain names are unique within a table, as iptables-save prints them.
        let mut seen = BTreeSet::new();
        chains.retain(|(c, _)| seen.insert(c.clone()));
        SaveTable {
            name,
            chains,
            rules,
        }
    })
}

fn doomed(name: &str) -> bool {
    name.starts_with(PREFIX) || name.starts_with("KUBE-")
}

/// Checks what `plan_removal` promises: it deletes only chains `remove` selects, never one a
/// remaining chain still refers to, and its text reads back.
fn check_removal(saved: &BTreeMap<String, iptables::SavedTable>) {
    let (text, removed) = plan_removal(saved, doomed);
    let back = parse_save(&text);
    for r in &removed {
        // `table/chain`; either may contain a `/` in corrupted input.
        let found = saved.iter().find_map(|(table, t)| {
            let chain = r.strip_prefix(table.as_str())?.strip_prefix('/')?;
            (t.chains.contains(chain) && doomed(chain)).then_some((table, t, chain))
        });
        let Some((table, t, chain)) = found else {
            panic!("{r} is not a selected chain");
        };
        assert!(!t.builtins.contains(chain), "{r} is built in");
        assert!(back[table].chains.contains(chain));
        let still_used = t.rules.iter().any(|(c, spec)| {
            !t.builtins.contains(c)
                && !removed.contains(&format!("{table}/{c}"))
                && jump_target(spec).as_deref() == Some(chain)
        });
        assert!(!still_used, "{r} is still referenced");
    }
}

#[test]
fn iptables_save_round_trip() {
    fuzz(
        "iptables_save_round_trip",
        100,
        vec(save_table(), 0..4),
        |tables| {
            let text: String = tables.iter().map(SaveTable::text).collect();
            let saved = parse_save(&text);
            // The last table of a name wins where names repeat.
            let mut by_name = BTreeMap::new();
            for t in &tables {
                by_name.insert(t.name.clone(), t);
            }
            assert_eq!(saved.len(), by_name.len());
            for (name, t) in by_name {
                let got = &saved[&name];
                let chains: BTreeSet<String> = t.chains.iter().map(|(c, _)| c.clone()).collect();
                let builtins: BTreeSet<String> = t
                    .chains
                    .iter()
                    .filter(|(_, p)| p.is_some())
                    .map(|(c, _)| c.clone())
                    .collect();
                // A table of the same name earlier in the text adds its chains and rules.
                assert!(got.chains.is_superset(&chains));
                assert!(got.builtins.is_superset(&builtins));
                let want: Vec<(String, String)> = t
                    .rules
                    .iter()
                    .map(|(c, args, target)| {
                        (
                            t.chains[c % t.chains.len()].0.clone(),
                            t.spec(args, target).0,
                        )
                    })
                    .collect();
                assert!(got.rules.ends_with(&want), "rules of {name}");
                for (c, args, target) in &t.rules {
                    let _ = c;
                    let (spec, all) = t.spec(args, target);
                    assert_eq!(tokens(&spec), all, "tokens of {spec:?}");
                    let jumps = all
                        .iter()
                        .filter(|a| matches!(a.as_str(), "-j" | "-g" | "--jump" | "--goto"))
                        .count();
                    if let (Some((_, t_idx)), 1) = (target, jumps) {
                        assert_eq!(
                            jump_target(&spec).as_deref(),
                            Some(t.chains[t_idx % t.chains.len()].0.as_str())
                        );
                    }
                }
            }
            check_removal(&saved);
            let existing = Existing::from_save(&text);
            for family in Family::ALL {
                let desired = iptables::build(
                    &Cluster::default(),
                    &BuildConfig::default(),
                    &IptablesOptions::default(),
                    family,
                );
                let _ = plan_full(&desired, &existing);
            }
        },
    );
}

#[test]
fn iptables_save_corrupted() {
    fuzz(
        "iptables_save_corrupted",
        100,
        (vec(save_table(), 0..4), vec(k8s::edit(), 0..8)),
        |(tables, edits)| {
            let mut text: String = tables.iter().map(SaveTable::text).collect();
            k8s::apply_edits(&mut text, &edits);
            let saved = parse_save(&text);
            check_removal(&saved);
            let existing = Existing::from_save(&text);
            let desired = iptables::build(
                &Cluster::default(),
                &BuildConfig::default(),
                &IptablesOptions::default(),
                Family::V4,
            );
            let _ = plan_full(&desired, &existing);
            for t in saved.values() {
                for (_, spec) in &t.rules {
                    let _ = jump_target(spec);
                }
            }
        },
    );
}

#[test]
fn iptables_save_raw_text() {
    fuzz(
        "iptables_save_raw_text",
        300,
        prop_oneof![
            any::<String>(),
            "([*:]|-A |COMMIT|\n| |\"|\\\\|-j |NFTPROXY-|KUBE-|[A-Z]{1,4}){0,80}",
        ],
        |text| {
            let saved = parse_save(&text);
            check_removal(&saved);
            let _ = Existing::from_save(&text);
            let _ = tokens(&text);
            let _ = jump_target(&text);
        },
    );
}

/// Chains of references many levels deep (a kept chain → doomed → doomed ...): removal keeps
/// them all, in time that the size of the input bounds.
#[test]
fn iptables_removal_deep_references() {
    fuzz(
        "iptables_removal_deep_references",
        8,
        (1usize..300, any::<bool>()),
        |(depth, kept_root)| {
            let mut text = String::from("*filter\n:INPUT ACCEPT [0:0]\n:ROOT - [0:0]\n");
            for i in 0..depth {
                text.push_str(&format!(":KUBE-C{i} - [0:0]\n"));
            }
            if kept_root {
                text.push_str("-A ROOT -j KUBE-C0\n");
            }
            text.push_str("-A INPUT -j KUBE-C0\n");
            for i in 1..depth {
                text.push_str(&format!(
                    "-A KUBE-C{} -m comment --comment \"x y\" -j KUBE-C{i}\n",
                    i - 1
                ));
            }
            text.push_str("COMMIT\n");
            let saved = parse_save(&text);
            let (_, removed) = plan_removal(&saved, doomed);
            assert_eq!(removed.len(), if kept_root { 0 } else { depth });
            check_removal(&saved);
        },
    );
}
