//! The planner: from what the kernel holds to what it should hold, as a list of operations.
//!
//! The kernel state is tracked per chain by a content fingerprint stored in the chain comment, so
//! a state read back from the kernel (after a restart) plans exactly like the in-memory state the
//! agent keeps after its own commits.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::nft::desired::{Before, Delta, Scope};
use crate::nft::ruleset::{Action, Chain, ElementMap, Key, Match, Set, Table, Value};
use crate::nft::state::{self, SetState, TableState, fingerprint};
use crate::nft::transaction::{Elements, Op, Transaction};

/// Whether any rule of `chain` refers to one of `sets` (a set in use cannot be deleted).
fn uses_any(chain: &Chain, sets: &BTreeSet<String>) -> bool {
    if sets.is_empty() {
        return false;
    }
    chain.rules.iter().any(|r| {
        let in_matches = r.matches.iter().any(|m| match m {
            Match::DaddrInSet { set }
            | Match::SaddrInSet { set }
            | Match::SaddrDaddrInSet { set }
            | Match::AddrProtoPortInSet { set }
            | Match::ProtoPortInSet { set }
            | Match::AddrProtoInSet { set }
            | Match::CtOriginalAddrProtoPortInSet { set }
            | Match::CtOriginalProtoPortInSet { set } => sets.contains(set),
            _ => false,
        });
        let in_action = match &r.action {
            Action::VmapAddrProtoPort { map } | Action::VmapProtoPort { map } => sets.contains(map),
            Action::UpdateSaddr { set } => sets.contains(set),
            Action::DnatRegion { map, .. } => sets.contains(*map),
            Action::DnatIndexed { map, .. } => sets.contains(map),
            Action::SetDaddr { map, .. } | Action::SetDport { map } => sets.contains(*map),
            Action::DnatShared {
                addresses, ports, ..
            } => sets.contains(*addresses) || sets.contains(*ports),
            Action::DnatAffinity { map } | Action::UpdateAffinity { map, .. } => {
                sets.contains(*map)
            }
            _ => false,
        };
        in_matches || in_action
    })
}

/// Largest number of elements per add/delete-elements operation. The encoder packs an op's
/// elements into messages by size, each well under the 64 KiB attribute-length limit; 2,000 per
/// op (a 5,000-endpoint Service in 3 ops instead of 25) made no difference measurable above the
/// run-to-run spread.
pub const ELEMENTS_PER_OP: usize = 200;

/// Items in lists of at most [`ELEMENTS_PER_OP`], filled as they come: collecting them all
/// first and then copying out the chunks would hold them twice.
struct Chunks<T>(Vec<Vec<T>>);

impl<T> Chunks<T> {
    fn new() -> Chunks<T> {
        Chunks(Vec::new())
    }

    fn push(&mut self, item: T) {
        match self.0.last_mut() {
            Some(chunk) if chunk.len() < ELEMENTS_PER_OP => chunk.push(item),
            _ => {
                let mut chunk = Vec::with_capacity(ELEMENTS_PER_OP);
                chunk.push(item);
                self.0.push(chunk);
            }
        }
    }
}

impl Chunks<(Key, Option<Value>)> {
    fn into_elements(self) -> Vec<Elements> {
        self.0.into_iter().map(Elements::Listed).collect()
    }
}

impl<T> FromIterator<T> for Chunks<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Chunks<T> {
        let mut chunks = Chunks::new();
        for item in items {
            chunks.push(item);
        }
        chunks
    }
}

/// `elements` in lists of at most [`ELEMENTS_PER_OP`].
fn in_chunks(elements: impl IntoIterator<Item = (Key, Option<Value>)>) -> Vec<Elements> {
    let chunks: Chunks<_> = elements.into_iter().collect();
    chunks.into_elements()
}

/// Plans the main transaction taking `current` to `desired`. The elements of the sets
/// `current` marks as the previous desired table's are found through `before`.
///
/// Chains that are no longer wanted are only flushed here; [`plan_cleanup`] deletes them in a
/// later transaction, once nothing refers to them any more (older kernels answer EBUSY when a
/// chain is deleted in the same transaction that drops the last map element pointing at it).
pub fn plan(current: Option<&TableState>, before: &Before, desired: &Table) -> Transaction {
    let before = match before {
        Before::Delta(delta) => Committed::Delta(delta),
        Before::Sets(sets) => Committed::Sets(sets),
        Before::Nothing => Committed::Nothing,
    };
    plan_with(current, before, desired)
}

/// [`Before`], borrowed.
#[derive(Clone, Copy)]
enum Committed<'a> {
    Delta(&'a Delta),
    Sets(&'a BTreeMap<String, Set>),
    Nothing,
}

/// The element operations taking a set from `have` to `want`: the keys to delete (those that
/// go or change value: the kernel refuses to add an element it holds with other data) and
/// the elements to add, found in one walk over both in key order.
fn diff(have: &ElementMap, want: &ElementMap) -> (Vec<Key>, Vec<(Key, Option<Value>)>) {
    let (mut del, mut add) = (Vec::new(), Vec::new());
    let mut have = have.iter().peekable();
    let mut want = want.iter().peekable();
    loop {
        let order = match (have.peek(), want.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((h, _)), Some((w, _))) => h.cmp(w),
        };
        match order {
            Ordering::Less => del.extend(have.next().map(|(k, _)| k)),
            Ordering::Greater => add.extend(want.next()),
            Ordering::Equal => {
                let (Some((key, was)), Some((_, now))) = (have.next(), want.next()) else {
                    unreachable!("both peeked")
                };
                if was != now {
                    del.push(key);
                    add.push((key, now));
                }
            }
        }
    }
    (del, add)
}

fn plan_with(current: Option<&TableState>, before: Committed<'_>, desired: &Table) -> Transaction {
    let empty = TableState::default();
    let cur = current.unwrap_or(&empty);
    let mut ops = Vec::new();
    if current.is_none() {
        ops.push(Op::AddTable);
    }

    // Sets whose declaration changed are recreated: the kernel cannot alter a set's type. So
    // are sets whose elements are not known (never the case in the agent).
    let mut recreate_sets = BTreeSet::new();
    for (name, set) in &desired.sets {
        match cur.sets.get(name) {
            Some(s)
                if s.decl == set.decl
                    && !(s.elements == state::Elements::Desired
                        && matches!(before, Committed::Nothing)) => {}
            Some(_) => {
                recreate_sets.insert(name.clone());
            }
            None => ops.push(Op::AddSet {
                name: name.clone(),
                decl: set.decl.clone(),
            }),
        }
    }

    // New chains first (empty), so that rules and map elements may refer to them.
    let mut rewrite = Vec::new();
    for (name, chain) in &desired.chains {
        let fp = fingerprint(chain);
        match cur.chains.get(name) {
            Some(c)
                if c.fingerprint == Some(fp)
                    && c.base == chain.base
                    && c.empty == chain.rules.is_empty()
                    && !uses_any(chain, &recreate_sets) => {}
            Some(c) => {
                if c.base != chain.base {
                    // Hook or priority changed: the kernel cannot alter it in place.
                    ops.push(Op::DeleteChain { name: name.clone() });
                }
                rewrite.push((name, chain, fp, !c.empty && c.base == chain.base));
            }
            None => rewrite.push((name, chain, fp, false)),
        }
    }
    let mut flush_ops = Vec::new();
    let mut rule_ops = Vec::new();
    for (name, chain, fp, flush) in rewrite {
        ops.push(Op::AddChain {
            name: name.clone(),
            base: chain.base,
            comment: chain.comment.clone(),
            fingerprint: fp,
        });
        if flush {
            flush_ops.push(Op::FlushChain { name: name.clone() });
        }
        if !chain.rules.is_empty() {
            rule_ops.push(Op::AddRules {
                chain: name.clone(),
                rules: chain.rules.clone(),
            });
        }
    }

    // Elements that disappear or change value go before any rule rewrite.
    let empty = ElementMap::new();
    let mut add_elements = Vec::new();
    for (name, set) in &desired.sets {
        if recreate_sets.contains(name) {
            continue;
        }
        let (del, add): (Chunks<Key>, _) = match cur.sets.get(name).map(|s| (&s.elements, before)) {
            None => (
                Chunks::new(),
                Elements::runs_of(&set.elements, ELEMENTS_PER_OP),
            ),
            Some((state::Elements::Read(have), _)) => {
                let (del, add) = diff(have, &set.elements);
                (del.into_iter().collect(), in_chunks(add))
            }
            Some((state::Elements::Desired, Committed::Sets(old))) => {
                let have = old.get(name).map_or(&empty, |s| &s.elements);
                let (del, add) = diff(have, &set.elements);
                (del.into_iter().collect(), in_chunks(add))
            }
            Some((state::Elements::Desired, Committed::Delta(delta))) => {
                // Only the elements the change touched can differ.
                let touched = delta.get(name).into_iter().flatten();
                let nows = set.elements.get_each(touched.clone().map(|(k, _)| k));
                let mut del = Chunks::new();
                let mut add = Chunks::new();
                for ((k, was), now) in touched.zip(nows) {
                    if now.as_ref() == was.as_ref() {
                        continue;
                    }
                    if was.is_some() {
                        del.push(*k);
                    }
                    if let Some(v) = now {
                        add.push((*k, v));
                    }
                }
                (del, add.into_elements())
            }
            Some((state::Elements::Desired, Committed::Nothing)) => unreachable!("recreated above"),
        };
        for keys in del.0 {
            ops.push(Op::DeleteElements {
                set: name.clone(),
                keys,
            });
        }
        if !add.is_empty() {
            add_elements.push((name.clone(), add));
        }
    }
    // Elements of sets no longer wanted, and of sets about to be recreated, are dropped with the
    // set; stale chains are emptied so nothing refers to anything stale any more.
    for (name, state) in &cur.chains {
        if !desired.chains.contains_key(name) && !state.empty {
            flush_ops.push(Op::FlushChain { name: name.clone() });
        }
    }
    // Flushes before recreating sets (a set in use cannot be deleted), rules after (they may
    // refer to the recreated sets).
    ops.extend(flush_ops);
    let mut recreate_ops = Vec::new();
    for name in &recreate_sets {
        recreate_ops.push(Op::DeleteSet { name: name.clone() });
        let set = &desired.sets[name];
        recreate_ops.push(Op::AddSet {
            name: name.clone(),
            decl: set.decl.clone(),
        });
        add_elements.push((
            name.clone(),
            Elements::runs_of(&set.elements, ELEMENTS_PER_OP),
        ));
    }
    ops.extend(recreate_ops);
    ops.extend(rule_ops);
    for (name, add) in add_elements {
        for elements in add {
            ops.push(Op::AddElements {
                set: name.clone(),
                elements,
            });
        }
    }
    for name in cur.sets.keys() {
        if !desired.sets.contains_key(name) {
            ops.push(Op::DeleteSet { name: name.clone() });
        }
    }
    Transaction {
        family: desired.family,
        ops,
    }
}

/// Plans the transaction for a change confined to `scope` (see [`crate::nft::desired`]): what
/// [`plan`] gives for the whole table, found by comparing only what the scope names, so it costs
/// O(change) instead of O(table). The sets `current` marks as the previous desired table's
/// held what the scope records for the elements it touched.
pub fn plan_scope(current: &TableState, desired: &Table, scope: &Scope) -> Transaction {
    let mut cur = TableState::default();
    let mut want = Table::new(desired.family);
    for name in &scope.chains {
        if let Some(c) = current.chains.get(name) {
            cur.chains.insert(name.clone(), c.clone());
        }
        if let Some(c) = desired.chains.get(name) {
            want.chains.insert(name.clone(), c.clone());
        }
    }
    for name in &scope.sets {
        if let Some(s) = current.sets.get(name) {
            cur.sets.insert(name.clone(), s.clone());
        }
        if let Some(s) = desired.sets.get(name) {
            want.sets.insert(name.clone(), s.clone());
        }
    }
    for (name, keys) in &scope.elements {
        if scope.sets.contains(name) {
            continue;
        }
        // The keys are sorted: the picked elements are built in bulk.
        let pick = |elements: &ElementMap| {
            ElementMap::from_sorted(
                keys.keys()
                    .filter_map(|k| elements.get(k).map(|v| (*k, v)))
                    .collect(),
            )
        };
        if let Some(s) = current.sets.get(name) {
            let elements = match &s.elements {
                state::Elements::Read(have) => state::Elements::Read(pick(have)),
                state::Elements::Desired => state::Elements::Desired,
            };
            cur.sets.insert(
                name.clone(),
                SetState {
                    decl: s.decl.clone(),
                    elements,
                },
            );
        }
        if let Some(s) = desired.sets.get(name) {
            // A set the state marks as the desired table's is planned from the scope's keys
            // alone (`Committed::Delta`), which look the desired elements up where they are.
            let elements = match current.sets.get(name).map(|s| &s.elements) {
                Some(state::Elements::Desired) => s.elements.clone(),
                _ => Arc::new(pick(&s.elements)),
            };
            want.sets.insert(
                name.clone(),
                Set {
                    decl: s.decl.clone(),
                    elements,
                },
            );
        }
    }
    plan_with(Some(&cur), Committed::Delta(&scope.elements), &want)
}

/// [`plan_cleanup`] for the chains of `scope` only.
pub fn plan_cleanup_scope(current: &TableState, desired: &Table, scope: &Scope) -> Transaction {
    let ops = scope
        .chains
        .iter()
        .filter(|name| !desired.chains.contains_key(*name))
        .filter(|name| current.chains.get(*name).is_some_and(|c| c.empty))
        .map(|name| Op::DeleteChain { name: name.clone() })
        .collect();
    Transaction {
        family: desired.family,
        ops,
    }
}

/// Rules per transaction when [`split_new_chains`] splits one.
pub const RULES_PER_STAGE: usize = 5_000;

/// Splits a transaction whose new chains hold more than `rules_per_stage` rules into several,
/// so that the batch of a cold start (tens of MiB) never has to exist at once.
///
/// The transactions before the last create the table, new sets and new chains, and fill the
/// new regular chains, at most `rules_per_stage` rules each. Nothing can reach a chain that did
/// not exist before until a verdict-map element or a rule refers to it, and those (with the
/// rules of base chains) all stay in the last transaction with everything else, so every
/// intermediate state shows each Service entirely as before. If a later part fails, the chains
/// already committed are harmless: reading the table back shows them, and the empty ones are
/// filled by the next sync.
///
/// Transactions that delete sets or the table are not split (a rule committed early could pin
/// a set the last transaction deletes).
pub fn split_new_chains(
    current: Option<&TableState>,
    tx: Transaction,
    rules_per_stage: usize,
) -> Vec<Transaction> {
    enum Stage {
        Setup,
        NewRules(usize),
        Last,
    }
    let exists_chain = |name: &str| current.is_some_and(|c| c.chains.contains_key(name));
    let exists_set = |name: &str| current.is_some_and(|c| c.sets.contains_key(name));
    let new_regular: BTreeSet<&str> = tx
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::AddChain {
                name, base: None, ..
            } if !exists_chain(name) => Some(&**name),
            _ => None,
        })
        .collect();
    let parts: Vec<Stage> = tx
        .ops
        .iter()
        .map(|op| match op {
            Op::AddTable => Stage::Setup,
            Op::AddSet { name, .. } if !exists_set(name) => Stage::Setup,
            // Base chains are created early too (empty, they accept everything), so that
            // `nft list` shows the chains in the order a single transaction gives; their rules
            // wait for the last part.
            Op::AddChain { name, .. } if !exists_chain(name) => Stage::Setup,
            Op::AddRules { chain, rules } if new_regular.contains(&**chain) => {
                Stage::NewRules(rules.len())
            }
            _ => Stage::Last,
        })
        .collect();
    let deletes = tx
        .ops
        .iter()
        .any(|op| matches!(op, Op::DeleteSet { .. } | Op::DeleteTable));
    let movable: usize = parts
        .iter()
        .map(|p| match p {
            Stage::NewRules(n) => *n,
            _ => 0,
        })
        .sum();
    if deletes || movable <= rules_per_stage {
        return vec![tx];
    }
    let family = tx.family;
    let part = |ops| Transaction { family, ops };
    let mut out = vec![part(Vec::new())];
    let mut last = Vec::new();
    let mut rules_in_stage = 0;
    let mut fills = Vec::new();
    for (op, p) in tx.ops.into_iter().zip(parts) {
        match p {
            Stage::Setup => out[0].ops.push(op),
            Stage::NewRules(n) => fills.push((op, n)),
            Stage::Last => last.push(op),
        }
    }
    for (op, n) in fills {
        if rules_in_stage > 0 && rules_in_stage + n > rules_per_stage {
            out.push(part(Vec::new()));
            rules_in_stage = 0;
        }
        rules_in_stage += n;
        out.last_mut().expect("never empty").ops.push(op);
    }
    out.push(part(last));
    out.retain(|t| !t.is_empty());
    out
}

/// Plans the deletion of chains that `desired` no longer has and that are already empty.
pub fn plan_cleanup(current: &TableState, desired: &Table) -> Transaction {
    let ops = current
        .chains
        .iter()
        .filter(|(name, state)| state.empty && !desired.chains.contains_key(*name))
        .map(|(name, _)| Op::DeleteChain { name: name.clone() })
        .collect();
    Transaction {
        family: desired.family,
        ops,
    }
}
