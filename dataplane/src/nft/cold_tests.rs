use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::nft::ruleset::{
    Action, BaseChain, ChainType, Family, Hook, Key, KeyType, Rule, SetDecl, Verdict,
};

fn rules(n: usize) -> Arc<Vec<Rule>> {
    Arc::new(vec![Rule::new(vec![], Action::Verdict(Verdict::Accept)); n])
}

fn chain(name: &str, base: bool) -> Op {
    Op::AddChain {
        name: name.into(),
        base: base.then_some(BaseChain {
            chain_type: ChainType::Nat,
            hook: Hook::Prerouting,
            priority: -100,
        }),
        comment: None,
        fingerprint: 0,
    }
}

fn elements(set: usize, n: usize) -> Op {
    Op::AddElements {
        set: format!("set{set}"),
        elements: (0..n)
            .map(|i| (Key::Addr(IpAddr::V4(Ipv4Addr::from(i as u32))), None))
            .collect(),
    }
}

/// The planner's transaction for a new table: the table, `sets.len()` sets with that many
/// elements each, a regular chain with `regular` rules and a base chain with a rule; in parts
/// as `plan::split_new_chains` cuts them when `split` (setup, the regular chain's rules, the
/// rest).
fn cold(sets: &[usize], regular: usize, split: bool) -> Vec<Transaction> {
    let mut setup = vec![Op::AddTable];
    setup.extend((0..sets.len()).map(|i| Op::AddSet {
        name: format!("set{i}"),
        decl: SetDecl::new(KeyType::Addr),
    }));
    setup.push(chain("base", true));
    setup.push(chain("svc", false));
    let fill = vec![Op::AddRules {
        chain: "svc".into(),
        rules: rules(regular),
    }];
    let mut last: Vec<Op> = sets
        .iter()
        .enumerate()
        .map(|(i, n)| elements(i, *n))
        .collect();
    last.push(Op::AddRules {
        chain: "base".into(),
        rules: rules(1),
    });
    let tx = |ops| Transaction {
        family: Family::V4,
        ops,
    };
    if split {
        vec![tx(setup), tx(fill), tx(last)]
    } else {
        vec![tx(setup.into_iter().chain(fill).chain(last).collect())]
    }
}

/// Each set's elements in the order the parts add them (an addition of none adds nothing).
fn elements_by_set(parts: &[Transaction]) -> BTreeMap<String, Vec<Key>> {
    let mut out: BTreeMap<String, Vec<Key>> = BTreeMap::new();
    for op in parts.iter().flat_map(|t| &t.ops) {
        if let Op::AddElements { set, elements } = op
            && !elements.is_empty()
        {
            out.entry(set.clone())
                .or_default()
                .extend(elements.iter().map(|(k, _)| k));
        }
    }
    out
}

/// The ops other than element additions, in order.
fn others(parts: &[Transaction]) -> Vec<&Op> {
    parts
        .iter()
        .flat_map(|t| &t.ops)
        .filter(|op| !matches!(op, Op::AddElements { .. }))
        .collect()
}

proptest! {
    /// The parts add the same elements and the same other objects, the table with its sets
    /// and chains and the regular chains' rules first, then elements (at most `per_part` per
    /// part), then the base chains' rules.
    #[test]
    fn parts_add_the_same_in_a_safe_order(
        sets in prop::collection::vec(0usize..300, 1..5),
        regular in 0usize..4,
        split: bool,
        per_part in 1usize..200,
    ) {
        let parts = cold(&sets, regular, split);
        let out = split_cold_elements(None, parts.clone(), per_part);
        prop_assert_eq!(elements_by_set(&out), elements_by_set(&parts));
        let mut expected = others(&parts);
        // The setup ops move to the front, the rules keep their order.
        expected.sort_by_key(|op| matches!(op, Op::AddRules { .. }));
        prop_assert_eq!(others(&out), expected);
        let total: usize = sets.iter().sum();
        if total <= per_part {
            prop_assert_eq!(&out, &parts);
            return Ok(());
        }
        let setup_only = out[0].ops.iter().all(|op| match op {
            Op::AddTable | Op::AddSet { .. } | Op::AddChain { .. } => true,
            Op::AddRules { chain, .. } => &**chain != "base",
            _ => false,
        });
        prop_assert!(setup_only, "the first part does more than create objects and fill regular chains");
        let (last, middle) = out[1..].split_last().expect("elements and rules");
        for part in middle {
            let n: usize = part.ops.iter().map(|op| match op {
                Op::AddElements { elements, .. } => elements.len(),
                other => panic!("{other:?} between the first part and the last"),
            }).sum();
            prop_assert!(n <= per_part, "{} elements in a part", n);
        }
        let rules_only = last.ops.iter().all(|op| matches!(op, Op::AddRules { .. }));
        prop_assert!(rules_only, "the last part does more than add rules");
        prop_assert_eq!(
            last.ops.last(),
            Some(&Op::AddRules { chain: "base".into(), rules: rules(1) })
        );
        prop_assert!(out.iter().all(|t| !t.is_empty()));
    }
}

#[test]
fn an_existing_table_is_left_whole() {
    let parts = cold(&[500], 1, false);
    let current = TableState::default();
    assert_eq!(
        split_cold_elements(Some(&current), parts.clone(), 10),
        parts
    );
}

#[test]
fn deletions_are_left_whole() {
    let mut parts = cold(&[500], 1, false);
    parts[0].ops.push(Op::DeleteSet { name: "old".into() });
    assert_eq!(split_cold_elements(None, parts.clone(), 10), parts);
}

#[test]
fn a_large_set_is_cut_across_parts() {
    let out = split_cold_elements(None, cold(&[25, 10], 1, false), 10);
    let sizes: Vec<Vec<usize>> = out
        .iter()
        .map(|t| {
            t.ops
                .iter()
                .filter_map(|op| match op {
                    Op::AddElements { elements, .. } => Some(elements.len()),
                    _ => None,
                })
                .collect()
        })
        .collect();
    // Setup (and the regular chain's rules), then 10 + 10 + (5 + 5) + 5 elements, then the
    // base chain's rules.
    assert_eq!(
        sizes,
        vec![vec![], vec![10], vec![10], vec![5, 5], vec![5], vec![]]
    );
}
