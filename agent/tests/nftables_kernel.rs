//! The netlink backend against the real kernel. Needs root: every test creates its own network
//! namespace (`ip netns add nftp-nl-<pid>-<n>`), talks to nf_tables only inside it, checks the
//! result with `ip netns exec <ns> nft list table ...`, and deletes the namespace when done,
//! even on panic. The root namespace's rules are never touched.

use dataplane::nft::ruleset::ElementMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use dataplane::nft::desired::Before;
use dataplane::nft::plan::{plan, plan_cleanup, split_new_chains};
use dataplane::nft::render;
use dataplane::nft::ruleset::{
    Action, BaseChain, Chain, ChainName, ChainType, Family, Hook, Key, KeyType, Match, Proto, Rule,
    Set, SetDecl, Table, Value, Verdict, endpoint_map_name, region_elements, region_offset,
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

#[path = "nftables_kernel/listing.rs"]
mod listing;
#[path = "nftables_kernel/shared.rs"]
mod shared;
#[path = "nftables_kernel/tables.rs"]
mod tables;

use self::listing::*;
use self::tables::*;

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
    let ips = b.sets.get_mut("service-ips").unwrap().elements_mut();
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
    let differs = |k: &Key, v: &Option<Value>, other: &ElementMap| other.get(k).as_ref() != Some(v);
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
        Some(&*desired.sets[endpoint_map_name(ENDPOINT_MAP)].elements),
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
    set_region(&mut b, 0, &region_targets(family, k + 1));
    let state = apply_and_check(&ns, &mut nft, &state, &b, "k+1 endpoints");

    // One endpoint replaced (same count, same bounds, other address).
    let mut c = b.clone();
    let mut targets = region_targets(family, k + 1);
    targets[1].0 = addrs(family).ep[0];
    set_region(&mut c, 0, &targets);
    let state = apply_and_check(&ns, &mut nft, &state, &c, "endpoint replaced");

    // With thousands of endpoints some intervals keep their bounds when one more comes: those
    // stay, their neighbours are replaced around them.
    let mut big = c.clone();
    set_region(&mut big, 0, &region_targets(family, 5000));
    let state = apply_and_check(&ns, &mut nft, &state, &big, "5000 endpoints");
    let mut bigger = big.clone();
    set_region(&mut bigger, 0, &region_targets(family, 5001));
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
    set_region(&mut d, 0, &region_targets(family, 1));
    set_region(&mut d, 5, &[]);
    set_region(&mut d, 6, &region_targets(family, 2));
    Arc::make_mut(&mut d.chains.get_mut("svc-slot-dns").unwrap().rules)[0] = Rule::new(
        vec![Match::L4Proto(Proto::Udp)],
        Action::DnatRegion {
            map: endpoint_map_name(ENDPOINT_MAP),
            offset: region_offset(6),
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
                )]
                .into(),
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
        map.elements_mut().insert(
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
fn cold_start_in_stages(family: Family) -> (Table, Vec<Transaction>) {
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
    let (t, parts) = cold_start_in_stages(family);
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
    let (t, parts) = cold_start_in_stages(family);
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
    let (_, mut parts) = cold_start_in_stages(family);
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
    let (t, parts) = cold_start_in_stages(family);

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

/// A cold start cut by `split_cold_elements`: the table, sets and chains first, the elements
/// in parts, the rules last. Until the last part no base chain has a rule, so nothing in the
/// table is reachable; the elements arrive part by part; the end is the whole table.
#[test]
fn a_cold_start_cut_by_elements_is_inert_until_its_last_part() {
    nftproxy_tests::require_root!();
    let family = Family::V4;
    let ns = Netns::new("coldparts");
    let mut nft = ns.open();
    let t = many_services(family, 300);
    let parts = dataplane::nft::cold::split_cold_elements(
        None,
        split_new_chains(None, plan(None, &Before::Nothing, &t), 100),
        50,
    );
    let (last, early) = parts.split_last().unwrap();
    let element_parts = early
        .iter()
        .filter(|p| p.ops.iter().all(|op| matches!(op, Op::AddElements { .. })))
        .count();
    assert!(element_parts >= 6, "{element_parts} element parts");
    let mut elements = 0;
    for part in early {
        nft.apply(part).expect("apply a part");
        let read = nft.read_table(family).unwrap().expect("table");
        for (name, chain) in &t.chains {
            if chain.base.is_some() {
                assert!(read.chains[name].empty, "base chain {name} has rules early");
            }
        }
        let now: usize = read
            .sets
            .values()
            .map(|s| s.elements.read().map_or(0, |e| e.len()))
            .sum();
        assert!(now >= elements, "elements went from {elements} to {now}");
        elements = now;
    }
    assert!(elements > 0, "no elements before the last part");
    nft.apply(last).expect("apply the last part");
    let state = assert_idempotent(&mut nft, &t);
    assert_eq!(
        state.sets["service-ips"].elements.read().unwrap().len(),
        300
    );
    assert_listing(&ns, &t, false);
}

/// A cold start commits in small parts only while another process listens to nf_tables
/// notifications: the agent sees `nft monitor` in its namespace, and only there.
#[test]
fn another_process_listening_is_seen_in_the_namespace_only() {
    use nftproxy::nftables::kernel::{Netlink, NftKernel};
    use std::process::{Command, Stdio};
    nftproxy_tests::require_root!();
    let ns = Netns::new("heard");
    let other = Netns::new("quiet");
    let listens = |ns: &Netns| ns.run(|| Netlink::open().expect("netlink").others_listen());
    assert!(!listens(&ns), "nobody listens yet");
    let mut monitor = Command::new("ip")
        .args(["netns", "exec", &ns.name, "nft", "monitor"])
        .stdout(Stdio::null())
        .spawn()
        .expect("start nft monitor");
    // `nft monitor` subscribes as it starts.
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    while !listens(&ns) && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let heard = listens(&ns);
    let heard_elsewhere = listens(&other);
    // Stopped by its PID.
    monitor.kill().ok();
    monitor.wait().ok();
    assert!(heard, "nft monitor not seen");
    assert!(!heard_elsewhere, "a listener in another namespace was seen");
    // The agent's own monitor does not count.
    let portid = ns.open().portid();
    let _own = ns.run(move || Monitor::open(portid).expect("open the monitor"));
    assert!(!listens(&ns), "our own monitor counted as another process");
}
