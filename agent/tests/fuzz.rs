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

#[path = "fuzz/config.rs"]
mod config;
#[path = "fuzz/nft_dump.rs"]
mod nft_dump;

use self::config::*;
use self::nft_dump::*;

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
