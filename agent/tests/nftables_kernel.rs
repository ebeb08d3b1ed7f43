//! The netlink backend against the real kernel. Needs root: every test creates its own network
//! namespace (`ip netns add nftp-nl-<pid>-<n>`), talks to nf_tables only inside it, checks the
//! result with `ip netns exec <ns> nft list table ...`, and deletes the namespace when done,
//! even on panic. The root namespace's rules are never touched.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use dataplane::nft::desired::Before;
use dataplane::nft::plan::{plan, plan_cleanup, split_new_chains};
use dataplane::nft::render;
use dataplane::nft::ruleset::{
    Action, BaseChain, Chain, ChainName, ChainType, Family, Hook, Key, KeyType, Match, Proto, Rule,
    Set, SetDecl, Table, Value, Verdict, endpoint_map_name, slot_elements, slot_offset,
};
use dataplane::nft::state::TableState;
use dataplane::nft::transaction::{Op, Transaction};
use ipnet::IpNet;
use nftproxy::nftables::monitor::Monitor;
use nftproxy::nftables::{NftError, Nftables};

mod common;
use common::Netns;

/// The nftables-specific helpers on the shared namespace.
trait NftNs {
    fn open(&self) -> Nftables;
    fn nft(&self, args: &[&str]) -> (bool, String);
    fn list(&self, family: Family) -> String;
}

impl NftNs for Netns {
    /// Opens the backend inside the namespace; the socket stays in it.
    fn open(&self) -> Nftables {
        self.run(|| Nftables::open().expect("open netlink socket"))
    }

    fn nft(&self, args: &[&str]) -> (bool, String) {
        let argv: Vec<&str> = std::iter::once("nft").chain(args.iter().copied()).collect();
        let (ok, out, err) = self.try_exec(&argv);
        (ok, out + &err)
    }

    fn list(&self, family: Family) -> String {
        let (ok, text) = self.nft(&["list", "table", family.nft_name(), "nftproxy"]);
        assert!(ok, "nft list failed: {text}");
        text
    }
}

// --- Normalising `nft list` and `render::table_text` for comparison. ---

fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// nft prints durations like `3h` or `1m30s`; render prints seconds.
fn duration_secs(text: &str) -> Option<u64> {
    let mut total = 0;
    let mut num = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num.parse().ok()?;
        num.clear();
        total += match c {
            'd' => n * 86400,
            'h' => n * 3600,
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                n / 1000
            }
            'm' => n * 60,
            's' => n,
            _ => return None,
        };
    }
    num.is_empty().then_some(total)
}

/// nft prints standard priorities by name (`dstnat`, `filter - 10`); render prints numbers.
fn priority_value(expr: &str) -> Option<i64> {
    let parts: Vec<&str> = expr.split_whitespace().collect();
    let named = |n: &str| -> Option<i64> {
        Some(match n {
            "raw" => -300,
            "mangle" => -150,
            "dstnat" => -100,
            "filter" => 0,
            "security" => 50,
            "srcnat" => 100,
            _ => n.parse().ok()?,
        })
    };
    match parts.as_slice() {
        [n] => named(n),
        [n, "+", k] => Some(named(n)? + k.parse::<i64>().ok()?),
        [n, "-", k] => Some(named(n)? - k.parse::<i64>().ok()?),
        _ => None,
    }
}

/// The table's sets, maps and chains sorted, sets and maps first, each kind by name: nft lists
/// them in the order they were created, render by name.
fn sort_blocks(lines: Vec<String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut blocks: Vec<((u8, String), Vec<String>)> = Vec::new();
    let mut current: Option<((u8, String), Vec<String>)> = None;
    for line in lines {
        if let Some((_, block)) = current.as_mut() {
            let done = line == "}";
            block.push(line);
            if done {
                blocks.extend(current.take());
            }
            continue;
        }
        let header = line.strip_suffix(" {").and_then(|h| {
            let (kind, name) = h.split_once(' ')?;
            let rank = match kind {
                "set" | "map" => 0,
                "chain" => 1,
                _ => return None,
            };
            Some((rank, name.to_string()))
        });
        if let Some(key) = header {
            current = Some((key, vec![line]));
            continue;
        }
        if line == "}" {
            blocks.sort();
            out.extend(blocks.drain(..).flat_map(|(_, b)| b));
        }
        out.push(line);
    }
    assert!(current.is_none(), "unterminated block");
    out.extend(blocks.into_iter().flat_map(|(_, b)| b));
    out
}

/// Lines of a table listing, whitespace-collapsed, with element lists sorted (nft prints hash
/// sets in hash order), sets, maps and chains sorted by name, priorities as numbers, timeouts in
/// seconds, and nft's `size 65535` of dynamic sets dropped. `strip_fingerprints` also drops the
/// `[fingerprint]` of chain comments.
fn normalise(text: &str, strip_fingerprints: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    while let Some(line) = lines.next() {
        let mut line = collapse(line);
        if let Some(rest) = line.strip_prefix("elements = {") {
            let mut body = rest.to_string();
            while !body.trim_end().ends_with('}') {
                body.push(' ');
                body.push_str(lines.next().expect("unterminated element list"));
            }
            let inner = body.trim_end().strip_suffix('}').unwrap();
            let mut items: Vec<String> = inner
                .split(',')
                .map(collapse)
                .filter(|s| !s.is_empty())
                .collect();
            items.sort();
            out.push(format!("elements = {{ {} }}", items.join(", ")));
            continue;
        }
        if line == "size 65535" {
            continue;
        }
        if let Some(t) = line.strip_prefix("timeout ") {
            line = format!("timeout {}s", duration_secs(t).expect("duration"));
        }
        if let Some(start) = line.find(" priority ") {
            let rest = &line[start + " priority ".len()..];
            let end = rest.find(';').expect("priority ends with ;");
            let value = priority_value(&rest[..end]).expect("priority");
            line = format!("{} priority {value}{}", &line[..start], &rest[end..]);
        }
        if strip_fingerprints
            && line.starts_with("comment \"")
            && let Some(start) = line.rfind(" [")
            && line.ends_with("]\"")
        {
            line = format!("{}\"", &line[..start]);
        } else if strip_fingerprints && line.starts_with("comment \"[") && line.ends_with("]\"") {
            line = "comment \"\"".to_string();
        }
        out.push(line);
    }
    sort_blocks(out)
}

fn assert_listing(ns: &Netns, table: &Table, strip_fingerprints: bool) {
    let got = normalise(&ns.list(table.family), strip_fingerprints);
    let want = normalise(&render::table_text(table), strip_fingerprints);
    if got != want {
        let diff: Vec<String> = got
            .iter()
            .zip(want.iter())
            .filter(|(g, w)| g != w)
            .take(10)
            .map(|(g, w)| format!("  nft:    {g}\n  render: {w}"))
            .collect();
        panic!(
            "nft list differs from render ({} vs {} lines):\n{}\n--- nft list ---\n{}",
            got.len(),
            want.len(),
            diff.join("\n"),
            ns.list(table.family)
        );
    }
}

/// Reads the table back and checks that planning against it changes nothing.
fn assert_idempotent(nft: &mut Nftables, table: &Table) -> TableState {
    let state = nft
        .read_table(table.family)
        .expect("read_table")
        .expect("table exists");
    let again = plan(Some(&state), &Before::Nothing, table);
    assert!(
        again.is_empty(),
        "plan against the read-back state is not empty ({} ops):\n{}",
        again.ops.len(),
        first_lines(&render::transaction_text(&again), 30)
    );
    let cleanup = plan_cleanup(&state, table);
    assert!(
        cleanup.is_empty(),
        "cleanup plan is not empty:\n{}",
        render::transaction_text(&cleanup)
    );
    state
}

/// `state` with the fingerprints of chains that `desired` does not have cleared.
fn without_stale_fingerprints(mut state: TableState, desired: &Table) -> TableState {
    for (name, chain) in state.chains.iter_mut() {
        if !desired.chains.contains_key(name) {
            chain.fingerprint = None;
        }
    }
    state
}

fn first_lines(text: &str, n: usize) -> String {
    text.lines().take(n).collect::<Vec<_>>().join("\n")
}

// --- Test tables. ---

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

struct Addrs {
    vip: [IpAddr; 5],
    ep: [IpAddr; 2],
    host: IpNet,
    prefix: IpNet,
    other_prefix: IpNet,
}

fn addrs(family: Family) -> Addrs {
    match family {
        Family::V4 => Addrs {
            vip: [
                ip("10.96.0.1"),
                ip("10.96.0.2"),
                ip("10.96.0.3"),
                ip("10.96.0.4"),
                ip("10.96.0.5"),
            ],
            ep: [ip("10.244.1.2"), ip("10.244.2.3")],
            host: net("10.96.0.10/32"),
            prefix: net("10.244.0.0/16"),
            other_prefix: net("10.0.0.0/12"),
        },
        Family::V6 => Addrs {
            vip: [
                ip("fd00:96::1"),
                ip("fd00:96::2"),
                ip("fd00:96::3"),
                ip("fd00:96::4"),
                ip("fd00:96::5"),
            ],
            ep: [ip("fd00:244:1::2"), ip("fd00:244:2::3")],
            host: net("fd00:96::10/128"),
            prefix: net("fd00:244::/32"),
            other_prefix: net("fd00::/12"),
        },
    }
}

fn regular(comment: Option<&str>, rules: Vec<Rule>) -> Chain {
    Chain {
        base: None,
        comment: comment.map(Into::into),
        rules: Arc::new(rules),
    }
}

fn base(chain_type: ChainType, hook: Hook, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain {
        base: Some(BaseChain {
            chain_type,
            hook,
            priority,
        }),
        comment: Some(format!("{} hook", hook.name()).into()),
        rules: Arc::new(rules),
    }
}

fn set(key: KeyType, is_vmap: bool, comment: Option<&str>, timeout: Option<u32>) -> Set {
    Set {
        decl: SetDecl {
            key,
            is_vmap,
            comment: comment.map(Into::into),
            timeout_secs: timeout,
            size: None,
        },
        elements: BTreeMap::new(),
    }
}

fn jump(c: &str) -> Action {
    Action::Verdict(Verdict::Jump(c.into()))
}

fn goto(c: &str) -> Action {
    Action::Verdict(Verdict::Goto(c.into()))
}

/// The endpoint map of the test tables.
const ENDPOINT_MAP: usize = 3;

/// `n` endpoints on port 8080: 10.244.3.1, 10.244.3.2, ... (fd00:244:3::1, ... for IPv6).
fn slot_targets(family: Family, n: usize) -> Vec<(IpAddr, u16)> {
    (1..=n)
        .map(|i| {
            let addr = match family {
                Family::V4 => ip(&format!("10.244.{}.{}", 3 + i / 250, i % 250 + 1)),
                Family::V6 => ip(&format!("fd00:244:3::{i:x}")),
            };
            (addr, 8080)
        })
        .collect()
}

/// Gives `region` of the test table's endpoint map the endpoints `targets` (none: removes it).
fn set_region(t: &mut Table, region: u32, targets: &[(IpAddr, u16)]) {
    let offset = slot_offset(region);
    let map = t
        .sets
        .get_mut(endpoint_map_name(ENDPOINT_MAP))
        .expect("endpoint map");
    map.elements.retain(
        |k, _| !matches!(k, Key::Slot { at, .. } if dataplane::nft::ruleset::slot_region(*at) == region),
    );
    if !targets.is_empty() {
        map.elements.extend(
            slot_elements(offset, targets)
                .into_iter()
                .map(|(k, v)| (k, Some(v))),
        );
    }
}

/// A table using every Match and Action variant, both vmap kinds and all verdicts.
fn full_table(family: Family) -> Table {
    let a = addrs(family);
    let mut t = Table::new(family);

    let mut service_ips = set(
        KeyType::AddrProtoPort,
        true,
        Some("ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        None,
    );
    let verdicts = [
        Verdict::Goto("svc-a".into()),
        Verdict::Jump("svc-b".into()),
        Verdict::Drop,
        Verdict::Accept,
        Verdict::Return,
    ];
    for (i, v) in verdicts.into_iter().enumerate() {
        let proto = [Proto::Tcp, Proto::Udp, Proto::Sctp][i % 3];
        service_ips.elements.insert(
            Key::AddrProtoPort(a.vip[i], proto, 80 + i as u16),
            Some(v.into()),
        );
    }
    service_ips.elements.insert(
        Key::AddrProtoPort(a.vip[4], Proto::Tcp, 443),
        Some(Verdict::Goto("svc-slot".into()).into()),
    );
    service_ips.elements.insert(
        Key::AddrProtoPort(a.vip[4], Proto::Udp, 53),
        Some(Verdict::Goto("svc-slot-dns".into()).into()),
    );
    t.sets.insert("service-ips".into(), service_ips);

    // An endpoint map with two regions: 3 endpoints at region 0, 1 at region 5.
    t.sets.insert(
        endpoint_map_name(ENDPOINT_MAP).into(),
        set(KeyType::Slot, false, None, None),
    );
    set_region(&mut t, 0, &slot_targets(family, 3));
    set_region(&mut t, 5, &[(a.ep[1], 53)]);

    let mut nodeports = set(KeyType::ProtoPort, true, None, None);
    nodeports.elements.insert(
        Key::ProtoPort(Proto::Tcp, 30080),
        Some(Verdict::Goto("svc-a".into()).into()),
    );
    nodeports.elements.insert(
        Key::ProtoPort(Proto::Sctp, 30081),
        Some(Verdict::Drop.into()),
    );
    t.sets.insert("service-nodeports".into(), nodeports);

    let mut local = set(KeyType::Addr, false, Some("local addresses"), None);
    local.elements.insert(Key::Addr(a.vip[0]), None);
    local.elements.insert(Key::Addr(a.vip[1]), None);
    t.sets.insert("local-addrs".into(), local);

    t.sets.insert(
        "affinity-a".into(),
        set(
            KeyType::Addr,
            false,
            Some("ns/a:http affinity"),
            Some(10800),
        ),
    );
    t.sets.insert(
        "empty-set".into(),
        set(KeyType::AddrProtoPort, false, None, None),
    );

    t.chains.insert(
        "nat-prerouting".into(),
        base(
            ChainType::Nat,
            Hook::Prerouting,
            -100,
            vec![Rule::new(vec![], jump("services"))],
        ),
    );
    t.chains.insert(
        "nat-output".into(),
        base(
            ChainType::Nat,
            Hook::Output,
            -100,
            vec![Rule::new(vec![], jump("services"))],
        ),
    );
    t.chains.insert(
        "nat-postrouting".into(),
        base(
            ChainType::Nat,
            Hook::Postrouting,
            100,
            vec![
                Rule::new(
                    vec![Match::MarkUnset { mask: 0x4000 }],
                    Action::Verdict(Verdict::Return),
                ),
                Rule::new(vec![], Action::MarkXor(0x4000)),
                Rule::new(vec![], Action::Masquerade).with_comment("masquerade marked traffic"),
            ],
        ),
    );
    t.chains.insert(
        "filter-forward".into(),
        base(
            ChainType::Filter,
            Hook::Forward,
            0,
            vec![
                Rule::new(
                    vec![
                        Match::CtStateNew,
                        Match::Daddr {
                            net: a.host,
                            negate: false,
                        },
                        Match::Saddr {
                            net: a.prefix,
                            negate: true,
                        },
                        Match::Daddr {
                            net: a.other_prefix,
                            negate: false,
                        },
                        Match::Saddr {
                            net: a.host,
                            negate: true,
                        },
                        Match::IifName {
                            name: "eth0".into(),
                            prefix: false,
                            negate: false,
                        },
                        Match::IifName {
                            name: "veth".into(),
                            prefix: true,
                            negate: true,
                        },
                        Match::FibSaddrLocal,
                    ],
                    Action::Reject,
                )
                .with_comment("reject traffic to services without endpoints"),
                Rule::new(
                    vec![
                        Match::IifName {
                            name: "lo".into(),
                            prefix: false,
                            negate: true,
                        },
                        Match::IifName {
                            name: "cali".into(),
                            prefix: true,
                            negate: false,
                        },
                    ],
                    Action::Verdict(Verdict::Accept),
                ),
            ],
        ),
    );
    t.chains.insert(
        "filter-input".into(),
        base(
            ChainType::Filter,
            Hook::Input,
            -10,
            vec![
                Rule::new(
                    vec![Match::DaddrInSet {
                        set: "local-addrs".into(),
                    }],
                    Action::Verdict(Verdict::Drop),
                ),
                Rule::new(vec![], Action::Verdict(Verdict::Return)),
            ],
        ),
    );
    t.chains.insert(
        "services".into(),
        regular(
            Some("service dispatch"),
            vec![
                Rule::new(
                    vec![],
                    Action::VmapAddrProtoPort {
                        map: "service-ips".into(),
                    },
                ),
                Rule::new(
                    vec![Match::FibDaddrLocal],
                    Action::VmapProtoPort {
                        map: "service-nodeports".into(),
                    },
                ),
            ],
        ),
    );
    t.chains.insert(
        "svc-a".into(),
        regular(
            Some("ns/a:http"),
            vec![
                Rule::new(
                    vec![Match::SaddrInSet {
                        set: "affinity-a".into(),
                    }],
                    goto("ep-a-0"),
                ),
                Rule::new(
                    vec![Match::Numgen {
                        modulus: 2,
                        value: 0,
                    }],
                    goto("ep-a-0"),
                ),
                Rule::new(
                    vec![Match::Numgen {
                        modulus: 2,
                        value: 1,
                    }],
                    goto("ep-a-1"),
                ),
            ],
        ),
    );
    for (i, ep) in a.ep.iter().enumerate() {
        t.chains.insert(
            format!("ep-a-{i}").into(),
            regular(
                Some(&format!("ns/a:http endpoint {ep}")),
                vec![
                    Rule::new(
                        vec![Match::Saddr {
                            net: IpNet::from(*ep),
                            negate: false,
                        }],
                        Action::MarkOr(0x4000),
                    ),
                    Rule::new(
                        vec![],
                        Action::UpdateSaddr {
                            set: "affinity-a".into(),
                        },
                    ),
                    Rule::new(
                        vec![Match::L4Proto(Proto::Tcp)],
                        Action::Dnat {
                            addr: *ep,
                            port: 8080,
                        },
                    ),
                ],
            ),
        );
    }
    t.chains.insert(
        "svc-b".into(),
        regular(
            None,
            vec![Rule::new(
                vec![
                    Match::L4Proto(Proto::Udp),
                    Match::DaddrInSet {
                        set: "local-addrs".into(),
                    },
                ],
                Action::Dnat {
                    addr: a.ep[1],
                    port: 53,
                },
            )],
        ),
    );
    t.chains.insert(
        "svc-slot".into(),
        regular(
            Some("ns/slot:https"),
            vec![
                Rule::new(vec![Match::CtStateNew], Action::MarkOr(0x4000)),
                Rule::new(
                    vec![Match::L4Proto(Proto::Tcp)],
                    Action::DnatSlot {
                        map: endpoint_map_name(ENDPOINT_MAP),
                        offset: slot_offset(0),
                    },
                ),
            ],
        ),
    );
    t.chains.insert(
        "svc-slot-dns".into(),
        regular(
            None,
            vec![
                Rule::new(
                    vec![Match::L4Proto(Proto::Udp)],
                    Action::DnatSlot {
                        map: endpoint_map_name(ENDPOINT_MAP),
                        offset: slot_offset(5),
                    },
                )
                .with_comment("dns"),
            ],
        ),
    );
    t.chains.insert("empty-chain".into(), regular(None, vec![]));
    t
}

fn check_full_table(family: Family) {
    let ns = Netns::new("nl");
    let mut nft = ns.open();
    assert!(nft.read_table(family).expect("read_table").is_none());
    let table = full_table(family);
    let tx = plan(None, &Before::Nothing, &table);
    let stats = nft.apply(&tx).expect("apply the full table");
    let messages: usize = tx
        .ops
        .iter()
        .map(|op| match op {
            Op::AddRules { rules, .. } => rules.len(),
            _ => 1,
        })
        .sum();
    assert_eq!(stats.messages, messages + 2);
    assert_listing(&ns, &table, false);

    let state = assert_idempotent(&mut nft, &table);
    // The read-back state is exactly what the planner tracks in memory after the commit.
    let mut tracked = TableState::default();
    tracked.apply(&tx);
    assert!(
        tracked.agrees_with(&state, &table),
        "{state:?}\n{tracked:?}"
    );

    // Applying the same full transaction again is harmless (everything is create-or-keep), but
    // appends the rules a second time; the planner never does that. Deleting works.
    assert!(nft.delete_table(family).expect("delete"));
    assert!(!nft.delete_table(family).expect("delete again"));
    assert!(nft.read_table(family).expect("read_table").is_none());
    assert_eq!(
        nft.apply(&Transaction {
            family,
            ops: vec![]
        })
        .expect("empty"),
        Default::default()
    );
}

#[test]
fn full_table_ipv4_lists_as_rendered_and_reads_back_idempotently() {
    nftproxy_tests::require_root!();
    check_full_table(Family::V4);
}

#[test]
fn full_table_ipv6_lists_as_rendered_and_reads_back_idempotently() {
    nftproxy_tests::require_root!();
    check_full_table(Family::V6);
}

#[test]
fn flush_delete_and_element_changes_round_trip() {
    nftproxy_tests::require_root!();
    let family = Family::V4;
    let ns = Netns::new("nl");
    let mut nft = ns.open();
    let a = full_table(family);
    nft.apply(&plan(None, &Before::Nothing, &a))
        .expect("apply A");
    let state_a = assert_idempotent(&mut nft, &a);

    // B: svc-b goes away (with its map element and the set only it used), svc-a is rewritten in
    // place, an element changes verdict, elements are added and removed, a chain is added.
    let mut b = a.clone();
    b.chains.remove("svc-b");
    b.sets.remove("local-addrs");
    Arc::make_mut(&mut b.chains.get_mut("filter-input").unwrap().rules).remove(0);
    let addrs = addrs(family);
    let ips = &mut b.sets.get_mut("service-ips").unwrap().elements;
    ips.retain(|_, v| v.as_ref().and_then(|v| v.verdict()?.target()) != Some("svc-b"));
    ips.insert(
        Key::AddrProtoPort(addrs.vip[2], Proto::Sctp, 82),
        Some(Verdict::Goto("svc-c".into()).into()),
    );
    ips.remove(&Key::AddrProtoPort(addrs.vip[3], Proto::Tcp, 83));
    Arc::make_mut(&mut b.chains.get_mut("svc-a").unwrap().rules)[1] = Rule::new(
        vec![Match::Numgen {
            modulus: 3,
            value: 0,
        }],
        goto("ep-a-0"),
    );
    b.chains.insert(
        "svc-c".into(),
        regular(
            Some("ns/c"),
            vec![Rule::new(vec![], Action::Verdict(Verdict::Drop))],
        ),
    );

    let tx = plan(Some(&state_a), &Before::Nothing, &b);
    let ops = render::transaction_text(&tx);
    assert!(ops.contains("flush chain ip nftproxy svc-a"), "{ops}");
    assert!(ops.contains("flush chain ip nftproxy svc-b"), "{ops}");
    assert!(
        ops.contains("delete element ip nftproxy service-ips"),
        "{ops}"
    );
    assert!(ops.contains("delete set ip nftproxy local-addrs"), "{ops}");
    nft.apply(&tx).expect("apply B");
    let mut tracked = state_a.clone();
    tracked.settle();
    tracked.apply(&tx);

    // svc-b is still there (empty) until the cleanup transaction.
    let state_b = nft.read_table(family).unwrap().unwrap();
    assert!(plan(Some(&state_b), &Before::Nothing, &b).is_empty());
    assert!(state_b.chains["svc-b"].empty);
    // The kernel keeps a chain's first comment when it is re-added, so only fingerprints
    // computed from the rules (what read_table does) agree with the planner's tracked state.
    // The tracked state keeps the old fingerprint of a flushed chain while the kernel's chain
    // is empty, so stale chains' fingerprints are left out of the comparison.
    assert!(
        without_stale_fingerprints(tracked.clone(), &b)
            .agrees_with(&without_stale_fingerprints(state_b.clone(), &b), &b)
    );
    let cleanup = plan_cleanup(&state_b, &b);
    assert_eq!(
        cleanup.ops,
        vec![Op::DeleteChain {
            name: "svc-b".into()
        }]
    );
    nft.apply(&cleanup).expect("cleanup");
    tracked.apply(&cleanup);
    let state = assert_idempotent(&mut nft, &b);
    assert!(tracked.agrees_with(&state, &b));
    // svc-a and filter-input were rewritten in place: their listed comments still carry the
    // fingerprint of A (see above), so fingerprints are left out of this comparison.
    assert_listing(&ns, &b, true);
}

/// Applies `plan(state, desired)` and checks the listing and the read-back; the new state.
fn apply_and_check(
    ns: &Netns,
    nft: &mut Nftables,
    state: &TableState,
    desired: &Table,
    what: &str,
) -> TableState {
    let tx = plan(Some(state), &Before::Nothing, desired);
    assert!(!tx.is_empty(), "{what}: nothing to do");
    let text = render::transaction_text(&tx);
    // Only the endpoint map changes: the rules that use it stay as they are.
    for op in &tx.ops {
        assert!(
            matches!(op, Op::AddElements { set, .. } | Op::DeleteElements { set, .. }
                if set.as_str() == endpoint_map_name(ENDPOINT_MAP)),
            "{what}: unexpected op in\n{text}"
        );
    }
    // Exactly the intervals that changed are deleted and added, in one transaction.
    let old = state.sets[endpoint_map_name(ENDPOINT_MAP)]
        .elements
        .read()
        .expect("read back");
    let new = &desired.sets[endpoint_map_name(ENDPOINT_MAP)].elements;
    let deleted: usize = tx
        .ops
        .iter()
        .map(|op| match op {
            Op::DeleteElements { keys, .. } => keys.len(),
            _ => 0,
        })
        .sum();
    let added: usize = tx
        .ops
        .iter()
        .map(|op| match op {
            Op::AddElements { elements, .. } => elements.len(),
            _ => 0,
        })
        .sum();
    // An interval that keeps its bounds but changes endpoint is deleted and added again.
    let differs =
        |k: &Key, v: &Option<Value>, other: &BTreeMap<Key, Option<Value>>| other.get(k) != Some(v);
    assert_eq!(
        deleted,
        old.iter().filter(|(k, v)| differs(k, v, new)).count(),
        "{what}"
    );
    assert_eq!(
        added,
        new.iter().filter(|(k, v)| differs(k, v, old)).count(),
        "{what}"
    );
    assert!(deleted > 0 && added > 0, "{what}:\n{text}");
    nft.apply(&tx)
        .unwrap_or_else(|e| panic!("{what}: {e}\n{text}"));
    let mut tracked = state.clone();
    tracked.settle();
    tracked.apply(&tx);
    assert_listing(ns, desired, false);
    let read = assert_idempotent(nft, desired);
    assert!(tracked.agrees_with(&read, desired), "{what}");
    assert_eq!(
        read.sets[endpoint_map_name(ENDPOINT_MAP)].elements.read(),
        Some(&desired.sets[endpoint_map_name(ENDPOINT_MAP)].elements),
        "{what}"
    );
    read
}

/// A region's endpoints change: the intervals whose bounds or endpoint changed are deleted and
/// added again in one transaction, the rules that use the map untouched.
fn check_endpoint_region_changes(family: Family) {
    let ns = Netns::new("slots");
    let mut nft = ns.open();
    let k = 3;
    let a = full_table(family);
    nft.apply(&plan(None, &Before::Nothing, &a))
        .expect("apply A");
    let state = assert_idempotent(&mut nft, &a);

    // One more endpoint: every interval of region 0 moves.
    let mut b = a.clone();
    set_region(&mut b, 0, &slot_targets(family, k + 1));
    let state = apply_and_check(&ns, &mut nft, &state, &b, "k+1 endpoints");

    // One endpoint replaced (same count, same bounds, other address).
    let mut c = b.clone();
    let mut targets = slot_targets(family, k + 1);
    targets[1].0 = addrs(family).ep[0];
    set_region(&mut c, 0, &targets);
    let state = apply_and_check(&ns, &mut nft, &state, &c, "endpoint replaced");

    // With thousands of endpoints some intervals keep their bounds when one more comes: those
    // stay, their neighbours are replaced around them.
    let mut big = c.clone();
    set_region(&mut big, 0, &slot_targets(family, 5000));
    let state = apply_and_check(&ns, &mut nft, &state, &big, "5000 endpoints");
    let mut bigger = big.clone();
    set_region(&mut bigger, 0, &slot_targets(family, 5001));
    let kept = bigger.sets[endpoint_map_name(ENDPOINT_MAP)]
        .elements
        .keys()
        .filter(|k| {
            big.sets[endpoint_map_name(ENDPOINT_MAP)]
                .elements
                .contains_key(k)
        })
        .count();
    assert!(kept > 1, "no interval survives: the step tests nothing new");
    let state = apply_and_check(&ns, &mut nft, &state, &bigger, "5001 endpoints");

    // Down to one endpoint, and region 5 moves to region 6 (another Service's region).
    let mut d = c.clone();
    set_region(&mut d, 0, &slot_targets(family, 1));
    set_region(&mut d, 5, &[]);
    set_region(&mut d, 6, &slot_targets(family, 2));
    Arc::make_mut(&mut d.chains.get_mut("svc-slot-dns").unwrap().rules)[0] = Rule::new(
        vec![Match::L4Proto(Proto::Udp)],
        Action::DnatSlot {
            map: endpoint_map_name(ENDPOINT_MAP),
            offset: slot_offset(6),
        },
    );
    let tx = plan(Some(&state), &Before::Nothing, &d);
    nft.apply(&tx).expect("apply D");
    let mut tracked = state.clone();
    tracked.settle();
    tracked.apply(&tx);
    let read = assert_idempotent(&mut nft, &d);
    assert!(
        without_stale_fingerprints(tracked, &d)
            .agrees_with(&without_stale_fingerprints(read, &d), &d)
    );
    // svc-slot-dns was rewritten in place: its listed comment keeps C's fingerprint.
    assert_listing(&ns, &d, true);
}

#[test]
fn endpoint_region_changes_ipv4() {
    nftproxy_tests::require_root!();
    check_endpoint_region_changes(Family::V4);
}

#[test]
fn endpoint_region_changes_ipv6() {
    nftproxy_tests::require_root!();
    check_endpoint_region_changes(Family::V6);
}

#[test]
fn failing_op_is_named_and_leaves_the_table_untouched() {
    nftproxy_tests::require_root!();
    let family = Family::V6;
    let ns = Netns::new("nl");
    let mut nft = ns.open();
    let table = full_table(family);
    nft.apply(&plan(None, &Before::Nothing, &table))
        .expect("apply");
    let before = ns.list(family);
    let state_before = nft.read_table(family).unwrap().unwrap();

    let addrs = addrs(family);
    let tx = Transaction {
        family,
        ops: vec![
            Op::AddElements {
                set: "service-ips".into(),
                elements: vec![(
                    Key::AddrProtoPort(addrs.vip[4], Proto::Udp, 9999),
                    Some(Verdict::Accept.into()),
                )],
            },
            Op::FlushChain {
                name: "svc-a".into(),
            },
            Op::AddRules {
                chain: "svc-a".into(),
                rules: Arc::new(vec![Rule::new(vec![], goto("no-such-chain"))]),
            },
            Op::AddChain {
                name: "later".into(),
                base: None,
                comment: Some("later".into()),
                fingerprint: 0,
            },
        ],
    };
    let err = nft
        .apply(&tx)
        .expect_err("jump to a missing chain must fail");
    match &err {
        NftError::Op {
            index, op, errno, ..
        } => {
            assert_eq!(*index, 2, "{err}");
            assert_eq!(*errno, libc::ENOENT, "{err}");
            assert!(
                op.contains("add rule ip6 nftproxy svc-a goto no-such-chain"),
                "{op}"
            );
        }
        other => panic!("unexpected error: {other}"),
    }
    assert_eq!(err.op_index(), Some(2));
    eprintln!("error as reported: {err}");
    assert_eq!(
        ns.list(family),
        before,
        "a failed transaction changed the table"
    );
    assert_eq!(nft.read_table(family).unwrap().unwrap(), state_before);

    // The socket is still usable and in sync after the failure.
    let tx = Transaction {
        family,
        ops: vec![Op::AddChain {
            name: "later".into(),
            base: None,
            comment: Some("later".into()),
            fingerprint: 0,
        }],
    };
    nft.apply(&tx).expect("apply after a failure");

    // An op that cannot be encoded is reported before anything is sent.
    let bad = Transaction {
        family,
        ops: vec![
            Op::FlushChain {
                name: "later".into(),
            },
            Op::AddRules {
                chain: "later".into(),
                rules: Arc::new(vec![Rule::new(
                    vec![],
                    Action::Dnat {
                        addr: ip("10.0.0.1"),
                        port: 80,
                    },
                )]),
            },
        ],
    };
    match nft.apply(&bad) {
        Err(NftError::Encode { index: 1, .. }) => {}
        other => panic!("expected an encode error, got {other:?}"),
    }
}

/// `services` Services, each a chain with two rules behind one `service-ips` map element.
fn many_services(family: Family, services: u32) -> Table {
    let mut t = Table::new(family);
    let mut map = set(KeyType::AddrProtoPort, true, Some("services"), None);
    for i in 0..services {
        let vip = IpAddr::from(std::net::Ipv4Addr::from(0x0a60_0000 + i));
        let ep = IpAddr::from(std::net::Ipv4Addr::from(0x0af4_0000 + i));
        let name: ChainName = format!("svc-{i}").into();
        map.elements.insert(
            Key::AddrProtoPort(vip, Proto::Tcp, 80),
            Some(Verdict::Goto(name.clone()).into()),
        );
        t.chains.insert(
            name,
            regular(
                Some(&format!("ns/svc-{i}:http")),
                vec![
                    Rule::new(vec![Match::CtStateNew], Action::MarkOr(0x4000)),
                    Rule::new(
                        vec![Match::L4Proto(Proto::Tcp)],
                        Action::Dnat {
                            addr: ep,
                            port: 8080,
                        },
                    ),
                ],
            ),
        );
    }
    t.sets.insert("service-ips".into(), map);
    t.chains.insert(
        "nat-prerouting".into(),
        base(
            ChainType::Nat,
            Hook::Prerouting,
            -100,
            vec![Rule::new(
                vec![],
                Action::VmapAddrProtoPort {
                    map: "service-ips".into(),
                },
            )],
        ),
    );
    t
}

#[test]
fn large_transaction_20k_services() {
    nftproxy_tests::require_root!();
    let family = Family::V4;
    let ns = Netns::new("nl");
    let mut nft = ns.open();
    // NFTP_SERVICES=40000 gives a 120,000-message, 31 MB transaction.
    let services: u32 = std::env::var("NFTP_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let t = many_services(family, services);

    let started = Instant::now();
    let tx = plan(None, &Before::Nothing, &t);
    let planned = started.elapsed();
    let started = Instant::now();
    let stats = nft.apply(&tx).expect("apply 20k services");
    let applied = started.elapsed();
    assert!(stats.messages >= 3 * services as usize, "{stats:?}");

    let started = Instant::now();
    let state = assert_idempotent(&mut nft, &t);
    let read = started.elapsed();
    assert_eq!(
        state.sets["service-ips"].elements.read().unwrap().len(),
        services as usize
    );

    let started = Instant::now();
    assert_listing(&ns, &t, false);
    let listed = started.elapsed();

    // An incremental change on top of the big table.
    let mut t2 = t.clone();
    Arc::make_mut(&mut t2.chains.get_mut("svc-7").unwrap().rules)[1] = Rule::new(
        vec![Match::L4Proto(Proto::Tcp)],
        Action::Dnat {
            addr: ip("10.1.2.3"),
            port: 9090,
        },
    );
    let tx2 = plan(Some(&state), &Before::Nothing, &t2);
    let started = Instant::now();
    nft.apply(&tx2).expect("incremental");
    let incremental = started.elapsed();
    eprintln!(
        "{services} services: {} messages, {} bytes; plan {planned:?}, apply {applied:?}, \
         read_table {read:?}, nft list + compare {listed:?}, incremental ({} ops) {incremental:?}",
        stats.messages,
        stats.bytes,
        tx2.ops.len()
    );
}

/// 300 Services and the cold start that writes them, split into parts of at most 100 rules.
fn cold_start_in_parts(family: Family) -> (Table, Vec<Transaction>) {
    let t = many_services(family, 300);
    let parts = split_new_chains(None, plan(None, &Before::Nothing, &t), 100);
    assert!(parts.len() >= 6, "{} parts", parts.len());
    (t, parts)
}

#[test]
fn a_split_cold_start_commits_in_parts_and_a_retry_completes_it() {
    nftproxy_tests::require_root!();
    let family = Family::V4;
    let ns = Netns::new("split");
    let mut nft = ns.open();
    let (t, parts) = cold_start_in_parts(family);
    let (last, early) = parts.split_last().unwrap();
    for part in early {
        nft.apply(part).expect("apply a part");
        // The chains are there, but nothing leads to them yet.
        let read = nft.read_table(family).unwrap().expect("table");
        assert!(read.sets["service-ips"].elements.read().unwrap().is_empty());
        assert!(read.chains["nat-prerouting"].empty);
    }
    // The last part is lost (as if it had failed): the next sync completes the table without
    // sending the chains again.
    let read = nft.read_table(family).unwrap();
    let retry = plan(read.as_ref(), &Before::Nothing, &t);
    let resent = |op: &Op| match op {
        Op::AddChain { name, .. } | Op::AddRules { chain: name, .. } => name.starts_with("svc-"),
        _ => false,
    };
    assert!(!retry.ops.iter().any(resent), "{retry:?}");
    assert!(retry.ops.len() <= last.ops.len() + 1, "{retry:?}");
    nft.apply(&retry).expect("apply the rest");
    let state = assert_idempotent(&mut nft, &t);
    assert_eq!(
        state.sets["service-ips"].elements.read().unwrap().len(),
        300
    );
    assert_listing(&ns, &t, false);
}

#[test]
fn parts_applied_together_commit_in_order_and_stop_at_the_first_failure() {
    nftproxy_tests::require_root!();
    let family = Family::V4;
    let ns = Netns::new("parts");
    let mut nft = ns.open();
    let (t, parts) = cold_start_in_parts(family);
    let sizes: Vec<usize> = parts.iter().map(|p| p.ops.len()).collect();
    let mut seen = Vec::new();
    let stats = nft
        .apply_all(parts, |part| seen.push(part.ops.len()))
        .expect("apply all parts");
    assert_eq!(seen, sizes);
    assert!(stats.messages > 300, "{stats:?}");
    let state = assert_idempotent(&mut nft, &t);
    assert_eq!(
        state.sets["service-ips"].elements.read().unwrap().len(),
        300
    );

    // The third part fails: the first two stay committed, nothing after it is sent.
    let ns = Netns::new("partsfail");
    let mut nft = ns.open();
    let (_, mut parts) = cold_start_in_parts(family);
    let filled_later = match parts[3].ops.first() {
        Some(Op::AddRules { chain, .. }) => chain.clone(),
        other => panic!("expected rules in the fourth part: {other:?}"),
    };
    parts[2].ops.push(Op::AddRules {
        chain: "no-such-chain".into(),
        rules: t.chains["svc-0"].rules.clone(),
    });
    let mut committed = 0;
    let err = nft
        .apply_all(parts, |_| committed += 1)
        .expect_err("the third part must fail");
    assert_eq!(committed, 2);
    assert!(
        matches!(&err, NftError::Op { op, .. } if op.contains("no-such-chain")),
        "{err}"
    );
    let read = nft.read_table(family).unwrap().expect("table");
    assert!(read.chains[&*filled_later].empty, "{filled_later} filled");
    assert!(read.sets["service-ips"].elements.read().unwrap().is_empty());
}

#[test]
fn paused_notifications_still_reveal_commits_by_others() {
    nftproxy_tests::require_root!();
    let family = Family::V4;
    let ns = Netns::new("quiet");
    let mut nft = ns.open();
    let portid = nft.portid();
    let mut monitor = ns.run(move || Monitor::open(portid).expect("open the monitor"));
    let missed = Arc::new(AtomicUsize::new(0));
    let quieter = {
        let missed = missed.clone();
        monitor.quieter(move || {
            missed.fetch_add(1, Ordering::SeqCst);
        })
    };
    let (t, parts) = cold_start_in_parts(family);

    // Only our own commits while paused: nothing was queued for the monitor, nothing missed.
    quieter
        .around(&mut nft, |nft| nft.apply_all(parts, |_| {}))
        .expect("apply all parts");
    assert_eq!(missed.load(Ordering::SeqCst), 0);
    assert_eq!(monitor.drain(), 0, "notifications arrived while paused");

    // Someone else commits between two of ours while paused: reported once resumed.
    quieter.around(&mut nft, |nft| {
        let (ok, out) = ns.nft(&["add", "chain", "ip", "nftproxy", "intruder"]);
        assert!(ok, "{out}");
        let state = nft.read_table(family).unwrap().expect("table");
        nft.apply(&plan(Some(&state), &Before::Nothing, &t))
            .expect("remove the intruder");
    });
    assert_eq!(missed.load(Ordering::SeqCst), 1);
    assert_eq!(monitor.drain(), 0);

    // Resumed: notifications flow again.
    let (ok, out) = ns.nft(&["add", "chain", "ip", "nftproxy", "intruder"]);
    assert!(ok, "{out}");
    assert!(monitor.drain() > 0, "no notification after resuming");
}

/// The fake kernel refuses what the kernel refuses: every case of `fake::cases`, sent on top
/// of the same table to both, is refused by both at the same operation with the same errno (or
/// accepted by both), and both hold the same table afterwards.
#[test]
fn the_fake_kernel_refuses_what_the_kernel_refuses() {
    use nftproxy::nftables::fake::FakeKernel;
    use nftproxy::nftables::fake::cases::{cases, setup};
    use nftproxy::nftables::kernel::NftKernel;
    for family in Family::ALL {
        for case in cases(family) {
            let ns = Netns::new("fake");
            let mut nft = ns.open();
            let fake = FakeKernel::new();
            nft.apply(&setup(family)).expect("the setup commits");
            fake.commit(&setup(family)).expect("the setup commits");
            let kernel = nft.apply(&case.tx).map(|_| ());
            let faked = fake.commit(&case.tx);
            let outcome = |r: &Result<(), NftError>| match r {
                Ok(()) => None,
                Err(e) => Some((e.op_index(), e.errno())),
            };
            assert_eq!(
                outcome(&faked),
                outcome(&kernel),
                "{} ({family:?}): the fake says {faked:?}, the kernel {kernel:?}",
                case.name
            );
            assert_eq!(
                case.refused.map(|(i, e)| (Some(i), Some(e))),
                outcome(&kernel),
                "{} ({family:?}): the case's expectation",
                case.name
            );
            let listed = normalise(&ns.list(family), false);
            let faked = normalise(&fake.render(family), false);
            assert_eq!(listed, faked, "{} ({family:?}): tables differ", case.name);
            assert_eq!(
                nft.read_table(family).unwrap(),
                NftKernel::read_table(&mut fake.clone(), family).unwrap(),
                "{} ({family:?}): read back",
                case.name
            );
        }
    }
}
