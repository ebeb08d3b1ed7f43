//! Transactions the kernel refuses, one per class the fake models, with the operation it
//! names and its errno, and a few it accepts that a stricter fake might refuse. The fake's unit
//! tests and the kernel test suite run the same list, so that the fake is held to the kernel.

use std::net::IpAddr;
use std::sync::Arc;

use dataplane::nft::ruleset::{
    Action, BaseChain, ChainName, ChainType, Family, Hook, Key, KeyType, Match, Proto, Rule,
    SetDecl, Value, Verdict,
};
use dataplane::nft::transaction::{Op, Transaction};

/// One transaction sent on top of [`setup`].
pub struct Case {
    pub name: &'static str,
    pub tx: Transaction,
    /// `Some((index, errno))`: the kernel refuses operation `index` with `errno`.
    pub refused: Option<(usize, i32)>,
}

fn ip(family: Family, n: u8) -> IpAddr {
    match family {
        Family::V4 => IpAddr::from([10, 0, 0, n]),
        Family::V6 => IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, u16::from(n)]),
    }
}

fn chain(name: &str) -> Op {
    Op::AddChain {
        name: name.into(),
        base: None,
        comment: None,
        fingerprint: 0,
    }
}

fn base_chain(name: &str, priority: i32) -> Op {
    Op::AddChain {
        name: name.into(),
        base: Some(BaseChain {
            chain_type: ChainType::Filter,
            hook: Hook::Input,
            priority,
        }),
        comment: None,
        fingerprint: 0,
    }
}

fn rules(chain: &str, rules: Vec<Rule>) -> Op {
    Op::AddRules {
        chain: chain.into(),
        rules: Arc::new(rules),
    }
}

fn goto(chain: &str) -> Option<Value> {
    let name: ChainName = chain.into();
    Some(Value::Verdict(Verdict::Goto(name)))
}

fn jump(chain: &str) -> Action {
    Action::Verdict(Verdict::Jump(chain.into()))
}

fn frontend(family: Family, n: u8) -> Key {
    Key::AddrProtoPort(ip(family, n), Proto::Tcp, 80)
}

fn vmap() -> SetDecl {
    SetDecl {
        is_vmap: true,
        ..SetDecl::new(KeyType::AddrProtoPort)
    }
}

/// A DNAT through the shared address list `sa` and the port map `sp`.
fn shared_dnat() -> Action {
    Action::DnatShared {
        addresses: "sa",
        ports: "sp",
        modulus: 2,
    }
}

/// An endpoint-map interval `at ..= end - 1` choosing endpoint `n`.
fn interval(family: Family, at: u32, end: u32, n: u8) -> (Key, Option<Value>) {
    (
        Key::Interval { at, end },
        Some(Value::Endpoint(ip(family, n), 8080)),
    )
}

/// The table every case starts from: set `s` (addresses, one element), verdict map `m` (one
/// element leading to chain `c`), chain `a` whose rule looks `s` up and jumps to `b`, the
/// empty chains `b` and `c`, the empty base chain `in` (filter input, priority 0), and the
/// endpoint map `e` with the interval 100 ..= 199.
pub fn setup(family: Family) -> Transaction {
    let ops = vec![
        Op::AddTable,
        Op::AddSet {
            name: "s".into(),
            decl: SetDecl::new(KeyType::Addr),
        },
        Op::AddSet {
            name: "m".into(),
            decl: vmap(),
        },
        chain("a"),
        chain("b"),
        chain("c"),
        base_chain("in", 0),
        rules(
            "a",
            vec![Rule::new(
                vec![Match::DaddrInSet { set: "s".into() }],
                jump("b"),
            )],
        ),
        Op::AddElements {
            set: "m".into(),
            elements: vec![(frontend(family, 1), goto("c"))].into(),
        },
        Op::AddElements {
            set: "s".into(),
            elements: vec![(Key::Addr(ip(family, 9)), None)].into(),
        },
        Op::AddSet {
            name: "e".into(),
            decl: SetDecl::new(KeyType::Interval),
        },
        Op::AddElements {
            set: "e".into(),
            elements: vec![interval(family, 100, 200, 1)].into(),
        },
    ];
    Transaction { family, ops }
}

/// The cases, for `family`.
pub fn cases(family: Family) -> Vec<Case> {
    use libc::{EBUSY, EEXIST, ENOENT};
    let case = |name, ops, refused| Case {
        name,
        tx: Transaction { family, ops },
        refused,
    };
    let accept = |rule_action| vec![Rule::new(vec![], rule_action)];
    vec![
        case(
            "a rule jumping to a missing chain",
            vec![rules("a", accept(jump("nowhere")))],
            Some((0, ENOENT)),
        ),
        case(
            "a rule looking up a missing set",
            vec![rules(
                "a",
                vec![Rule::new(
                    vec![Match::DaddrInSet {
                        set: "nothing".into(),
                    }],
                    Action::Verdict(Verdict::Accept),
                )],
            )],
            Some((0, ENOENT)),
        ),
        case(
            "a rule using a missing verdict map",
            vec![rules(
                "a",
                accept(Action::VmapAddrProtoPort {
                    map: "nothing".into(),
                }),
            )],
            Some((0, ENOENT)),
        ),
        case(
            "a rule added to a missing chain",
            vec![rules("nowhere", accept(Action::Verdict(Verdict::Accept)))],
            Some((0, ENOENT)),
        ),
        case(
            "a map element leading to a missing chain",
            vec![Op::AddElements {
                set: "m".into(),
                elements: vec![(frontend(family, 2), goto("nowhere"))].into(),
            }],
            Some((0, ENOENT)),
        ),
        case(
            "elements of a missing set",
            vec![Op::AddElements {
                set: "nothing".into(),
                elements: vec![(Key::Addr(ip(family, 3)), None)].into(),
            }],
            Some((0, ENOENT)),
        ),
        case(
            "deleting a chain a rule jumps to",
            vec![Op::DeleteChain { name: "b".into() }],
            Some((0, EBUSY)),
        ),
        case(
            "deleting a chain a map element leads to",
            vec![Op::DeleteChain { name: "c".into() }],
            Some((0, EBUSY)),
        ),
        case(
            "deleting a set a rule looks up",
            vec![Op::DeleteSet { name: "s".into() }],
            Some((0, EBUSY)),
        ),
        case(
            "a DNAT through a shared address list whose port map is missing",
            vec![
                Op::AddSet {
                    name: "sa".into(),
                    decl: SetDecl::new(KeyType::AddrProtoIndex),
                },
                chain("d"),
                rules("d", accept(shared_dnat())),
            ],
            Some((2, ENOENT)),
        ),
        case(
            "a rule matching destinations and protocols of a missing set",
            vec![
                Op::AddSet {
                    name: "sa".into(),
                    decl: SetDecl::new(KeyType::AddrProtoIndex),
                },
                Op::AddSet {
                    name: "sp".into(),
                    decl: SetDecl::new(KeyType::AddrProtoPortToPort),
                },
                chain("d"),
                rules(
                    "d",
                    vec![Rule::new(
                        vec![Match::AddrProtoInSet { set: "s2".into() }],
                        shared_dnat(),
                    )],
                ),
            ],
            Some((3, ENOENT)),
        ),
        case(
            "deleting a map a DNAT through a shared address list reads",
            vec![
                Op::AddSet {
                    name: "sa".into(),
                    decl: SetDecl::new(KeyType::AddrProtoIndex),
                },
                Op::AddSet {
                    name: "sp".into(),
                    decl: SetDecl::new(KeyType::AddrProtoPortToPort),
                },
                Op::AddSet {
                    name: "s2".into(),
                    decl: SetDecl::new(KeyType::AddrProto),
                },
                chain("d"),
                rules(
                    "d",
                    vec![Rule::new(
                        vec![Match::AddrProtoInSet { set: "s2".into() }],
                        shared_dnat(),
                    )],
                ),
                Op::DeleteSet { name: "sp".into() },
            ],
            Some((5, EBUSY)),
        ),
        case(
            "deleting a missing chain",
            vec![Op::DeleteChain {
                name: "nowhere".into(),
            }],
            Some((0, ENOENT)),
        ),
        case(
            "flushing a missing chain",
            vec![Op::FlushChain {
                name: "nowhere".into(),
            }],
            Some((0, ENOENT)),
        ),
        case(
            "deleting a missing element",
            vec![Op::DeleteElements {
                set: "s".into(),
                keys: vec![Key::Addr(ip(family, 7))],
            }],
            Some((0, ENOENT)),
        ),
        case(
            "adding an element that exists with other data",
            vec![Op::AddElements {
                set: "m".into(),
                elements: vec![(frontend(family, 1), goto("b"))].into(),
            }],
            Some((0, EEXIST)),
        ),
        case(
            "an interval overlapping another",
            vec![Op::AddElements {
                set: "e".into(),
                elements: vec![interval(family, 150, 250, 2)].into(),
            }],
            Some((0, EEXIST)),
        ),
        case(
            "an interval with the start of another and another end",
            vec![Op::AddElements {
                set: "e".into(),
                elements: vec![interval(family, 100, 150, 1)].into(),
            }],
            Some((0, EEXIST)),
        ),
        case(
            "an interval inside another",
            vec![Op::AddElements {
                set: "e".into(),
                elements: vec![interval(family, 120, 130, 1)].into(),
            }],
            Some((0, EEXIST)),
        ),
        case(
            "adjacent intervals, and an interval again with the same endpoint",
            vec![Op::AddElements {
                set: "e".into(),
                elements: vec![
                    interval(family, 200, 300, 2),
                    interval(family, 50, 100, 3),
                    interval(family, 100, 200, 1),
                ]
                .into(),
            }],
            None,
        ),
        case(
            "an interval replaced by two",
            vec![
                Op::DeleteElements {
                    set: "e".into(),
                    keys: vec![Key::Interval { at: 100, end: 200 }],
                },
                Op::AddElements {
                    set: "e".into(),
                    elements: vec![interval(family, 100, 150, 1), interval(family, 150, 200, 2)]
                        .into(),
                },
            ],
            None,
        ),
        case(
            "re-adding a set with another type",
            vec![Op::AddSet {
                name: "s".into(),
                decl: SetDecl::new(KeyType::AddrProtoPort),
            }],
            Some((0, EEXIST)),
        ),
        case(
            "re-adding a regular chain with a hook",
            vec![base_chain("a", 0)],
            Some((0, libc::EOPNOTSUPP)),
        ),
        case(
            "re-adding a base chain with another priority",
            vec![base_chain("in", 10)],
            Some((0, libc::EOPNOTSUPP)),
        ),
        case(
            "re-adding a base chain without its hook, or with the same one",
            vec![chain("in"), base_chain("in", 0)],
            None,
        ),
        case(
            "a rule jumping to a chain added later in the transaction",
            vec![rules("a", accept(jump("d"))), chain("d")],
            Some((0, ENOENT)),
        ),
        case(
            "an element leading to a chain added later in the transaction",
            vec![
                Op::AddElements {
                    set: "m".into(),
                    elements: vec![(frontend(family, 2), goto("d"))].into(),
                },
                chain("d"),
            ],
            Some((0, ENOENT)),
        ),
        case(
            "a refused last operation undoes the ones before it",
            vec![
                chain("d"),
                Op::AddElements {
                    set: "s".into(),
                    elements: vec![(Key::Addr(ip(family, 4)), None)].into(),
                },
                Op::FlushChain { name: "a".into() },
                rules("d", accept(jump("nowhere"))),
            ],
            Some((3, ENOENT)),
        ),
        case(
            "re-adding what exists, with the same data",
            vec![
                Op::AddTable,
                chain("a"),
                Op::AddSet {
                    name: "s".into(),
                    decl: SetDecl {
                        comment: Some("another comment".into()),
                        ..SetDecl::new(KeyType::Addr)
                    },
                },
                Op::AddElements {
                    set: "m".into(),
                    elements: vec![(frontend(family, 1), goto("c"))].into(),
                },
            ],
            None,
        ),
        case(
            "deleting a chain with rules that nothing refers to",
            vec![Op::DeleteChain { name: "a".into() }],
            None,
        ),
        case(
            "a flush and a deletion dropping the last references first",
            vec![
                Op::FlushChain { name: "a".into() },
                Op::DeleteChain { name: "b".into() },
                Op::DeleteElements {
                    set: "m".into(),
                    keys: vec![frontend(family, 1)],
                },
                Op::DeleteChain { name: "c".into() },
                Op::DeleteSet { name: "s".into() },
            ],
            None,
        ),
        case(
            "chains added before the rules and elements that refer to them",
            vec![
                chain("d"),
                rules("d", accept(jump("b"))),
                Op::AddElements {
                    set: "m".into(),
                    elements: vec![(frontend(family, 2), goto("d"))].into(),
                },
            ],
            None,
        ),
    ]
}
