//! Fuzz targets: the nf_tables dump decoder, fed real messages from the encoder (as they
//! are and mutated) and generated attribute trees.

use super::*;

// ---------------------------------------------------------------------------------------------
// nf_tables dumps.

pub(super) const NLMSG_HDRLEN: usize = 16;
pub(super) const NLA_F_NESTED: u16 = 1 << 15;
pub(super) const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub(super) const NFT_MSG_NEWCHAIN: u16 = 3;
pub(super) const NFT_MSG_NEWRULE: u16 = 6;
pub(super) const NFT_MSG_NEWSET: u16 = 9;
pub(super) const NFT_MSG_NEWSETELEM: u16 = 12;
pub(super) const NFTA_SET_ELEM_LIST_SET: u16 = 2;

/// A netlink attribute: a leaf, or a nest of attributes.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Nla {
    Leaf(u16, Vec<u8>),
    Nest(u16, Vec<Nla>),
}

/// The attributes of `buf` if it is exactly a list of well-formed attributes.
pub(super) fn split_nlas(buf: &[u8]) -> Option<Vec<(u16, &[u8])>> {
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
pub(super) fn tree(buf: &[u8]) -> Vec<Nla> {
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

pub(super) fn emit(nlas: &[Nla], out: &mut Vec<u8>) {
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
pub(super) fn message(kind: u16, family: u8, nlas: &[Nla]) -> Vec<u8> {
    let mut out = vec![0; NLMSG_HDRLEN];
    out.extend_from_slice(&[family, 0, 0, 0]);
    emit(nlas, &mut out);
    let len = out.len() as u32;
    out[0..4].copy_from_slice(&len.to_ne_bytes());
    out[4..6].copy_from_slice(&kind.to_ne_bytes());
    out
}

pub(super) fn msg_type(msg: &[u8]) -> u16 {
    msg.get(4..6)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .unwrap_or(0)
}

/// A dump as the decoder takes it: chains, rules, sets, and the element dumps by set name.
#[derive(Clone, Debug, Default)]
pub(super) struct Dump {
    pub(super) chains: Vec<Vec<u8>>,
    pub(super) rules: Vec<Vec<u8>>,
    pub(super) sets: Vec<Vec<u8>>,
    pub(super) elements: BTreeMap<String, Vec<Vec<u8>>>,
}

pub(super) fn set_name_of(msg: &[u8]) -> String {
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
    pub(super) fn of(messages: &[Vec<u8>]) -> Dump {
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

    pub(super) fn all_mut(&mut self) -> Vec<&mut Vec<u8>> {
        self.chains
            .iter_mut()
            .chain(self.rules.iter_mut())
            .chain(self.sets.iter_mut())
            .chain(self.elements.values_mut().flatten())
            .collect()
    }

    /// Decodes the dump; element dumps of sets it does not hold answer `missing`.
    pub(super) fn decode(
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
pub(super) enum ElementAnswer {
    Empty,
    Interrupted,
    Error,
}

pub(super) fn element_answer() -> impl Strategy<Value = ElementAnswer> {
    prop_oneof![
        4 => Just(ElementAnswer::Empty),
        1 => Just(ElementAnswer::Interrupted),
        1 => Just(ElementAnswer::Error),
    ]
}

pub(super) fn nft_config() -> impl Strategy<Value = BuildConfig> {
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

pub(super) fn family() -> impl Strategy<Value = Family> {
    prop_oneof![Just(Family::V4), Just(Family::V6)]
}

/// The desired table of a generated valid cluster.
pub(super) fn desired(cluster: &k8s::ValidCluster, config: &BuildConfig, family: Family) -> Table {
    let (objects, _) = dataplane::input::parse_yaml(&cluster.yaml()).expect("valid YAML");
    let (model, skipped) = convert::cluster(&objects, "node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    build(&model, config, family).table
}

/// Everything the agent does with a state it read: plan against it, clean up, find the UDP
/// frontends for conntrack cleanup.
pub(super) fn use_state(state: &TableState, desired: &Table) {
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
pub(super) fn nft_dump_round_trip() {
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
pub(super) fn interesting_u32() -> impl Strategy<Value = u32> {
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
pub(super) enum Mutation {
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

pub(super) fn mutation() -> impl Strategy<Value = Mutation> {
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
pub(super) fn with_nth(
    nlas: &mut Vec<Nla>,
    n: &mut usize,
    f: &mut dyn FnMut(&mut Vec<Nla>, usize),
) -> bool {
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

pub(super) fn count(nlas: &[Nla]) -> usize {
    nlas.iter()
        .map(|n| match n {
            Nla::Nest(_, inner) => 1 + count(inner),
            Nla::Leaf(..) => 1,
        })
        .sum()
}

/// Calls `f` on the `n`th (modulo their number) attribute of `nlas`.
pub(super) fn edit_nth(nlas: &mut Vec<Nla>, n: usize, f: &mut dyn FnMut(&mut Vec<Nla>, usize)) {
    let mut n = n % count(nlas).max(1);
    with_nth(nlas, &mut n, f);
}

/// The 4-byte leaves of `nlas`, depth first.
pub(super) fn four_byte_leaves(nlas: &mut [Nla]) -> Vec<&mut Vec<u8>> {
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
pub(super) fn nth_message(dump: &mut Dump, at: usize) -> Option<&mut Vec<u8>> {
    let mut all: Vec<&mut Vec<u8>> = dump.all_mut();
    if all.is_empty() {
        return None;
    }
    let i = at % all.len();
    Some(all.swap_remove(i))
}

/// `msg` with `m` applied.
pub(super) fn mutated(msg: &[u8], m: &Mutation) -> Vec<u8> {
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
pub(super) fn mutate(dump: &mut Dump, at: usize, m: &Mutation) {
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
pub(super) fn nft_dump_mutated() {
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
pub(super) fn note_state(target: &str, state: &TableState) {
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
pub(super) fn expr_name() -> impl Strategy<Value = Vec<u8>> {
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
pub(super) fn leaf_value() -> impl Strategy<Value = Vec<u8>> {
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
pub(super) fn nla_tree(depth: u32) -> BoxedStrategy<Vec<Nla>> {
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
pub(super) fn rule_message() -> impl Strategy<Value = Vec<u8>> {
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
pub(super) fn framed_message(kind: u16) -> impl Strategy<Value = Vec<u8>> {
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

pub(super) fn raw_message() -> impl Strategy<Value = Vec<u8>> {
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
pub(super) fn nft_dump_generated() {
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
