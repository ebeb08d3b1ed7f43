//! An in-memory nf_tables for tests that run without root (the knftables pattern): it applies
//! each transaction to a table of its own and refuses, with the kernel's errno, what the
//! kernel refuses, so that a planner or proxier bug that the kernel would reject fails here
//! too instead of passing against a lenient fake:
//!
//! - a reference to a chain or set that does not exist (a rule's `jump`/`goto`, set lookup,
//!   verdict map or `dnat … map`, a verdict-map element's `goto`), including one added later
//!   in the same transaction: `ENOENT`;
//! - deleting, flushing or adding to something that does not exist: `ENOENT`;
//! - deleting a chain or set still referenced by a rule or a verdict-map element: `EBUSY`;
//! - adding an element that exists with other data, or a set that exists with another type:
//!   `EEXIST`; a hook for a chain that exists with another hook or priority (or none):
//!   `EOPNOTSUPP`. Adding an existing table, chain, set of the same type or element with the
//!   same data is not an error: the agent sends `NLM_F_CREATE` without `NLM_F_EXCL`.
//!
//! A refused transaction changes nothing. The kernel test suite (`tests/nftables_kernel.rs`)
//! sends the same refused transactions to the real kernel and checks it refuses them alike.
//! Clones share one kernel (one network namespace), so a test keeps a handle on what the
//! proxiers it drives have committed.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dataplane::nft::render;
use dataplane::nft::ruleset::{
    Action, Chain, ElementMap, Family, Key, Match, Rule, Set, SetDecl, Table, Value,
};
use dataplane::nft::state::TableState;
use dataplane::nft::transaction::{Op, Transaction};

use super::kernel::NftKernel;
use super::{ApplyStats, NftError, describe_op};

/// One transaction as the fake saw it.
#[derive(Clone, Debug)]
pub struct Record {
    pub tx: Transaction,
    /// The kernel's answer: `None` if committed, else the errno of the refused operation.
    pub refused: Option<i32>,
}

#[derive(Default)]
struct State {
    tables: BTreeMap<Family, Table>,
    log: Vec<Record>,
    /// Families whose reads and commits fail (an injected fault), with the errno.
    broken: BTreeMap<Family, i32>,
    /// Operations whose nft text contains this are refused (an injected fault), as if the
    /// kernel could not program one Service.
    refuse: Option<String>,
    reads: usize,
}

/// An in-memory nf_tables shared by its clones.
#[derive(Clone, Default)]
pub struct FakeKernel {
    state: Arc<Mutex<State>>,
}

impl FakeKernel {
    pub fn new() -> FakeKernel {
        FakeKernel::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The family's table, `None` if there is none.
    pub fn table(&self, family: Family) -> Option<Table> {
        self.lock().tables.get(&family).cloned()
    }

    /// The family's table as `nft list table` would show it (`render::table_text`); empty if
    /// there is none.
    pub fn render(&self, family: Family) -> String {
        self.table(family)
            .map(|t| render::table_text(&t))
            .unwrap_or_default()
    }

    /// Every transaction sent so far, committed or refused, in order.
    pub fn transactions(&self) -> Vec<Record> {
        self.lock().log.clone()
    }

    /// Forgets the transactions recorded so far.
    pub fn clear_log(&self) {
        self.lock().log.clear();
    }

    /// How many times a table was read back.
    pub fn reads(&self) -> usize {
        self.lock().reads
    }

    /// From now on every read and commit of `family` fails with `errno` (`None`: works again).
    pub fn break_family(&self, family: Family, errno: Option<i32>) {
        let mut s = self.lock();
        match errno {
            Some(e) => s.broken.insert(family, e),
            None => s.broken.remove(&family),
        };
    }

    /// From now on an operation (for elements: an element) whose nft text contains `text` is
    /// refused with `EINVAL`, as the kernel refuses an invalid rule; `None`: no longer.
    pub fn refuse_matching(&self, text: Option<&str>) {
        self.lock().refuse = text.map(str::to_string);
    }

    /// Someone else changed the table (drift): `f` edits it directly, unchecked.
    pub fn tamper(&self, family: Family, f: impl FnOnce(&mut Option<Table>)) {
        let mut s = self.lock();
        let mut table = s.tables.remove(&family);
        f(&mut table);
        if let Some(t) = table {
            s.tables.insert(family, t);
        }
    }

    /// Applies `tx` as nf_tables would: all of it or, at the first refused operation, nothing.
    pub fn commit(&self, tx: &Transaction) -> Result<(), NftError> {
        let mut s = self.lock();
        if let Some(&errno) = s.broken.get(&tx.family) {
            s.log.push(Record {
                tx: tx.clone(),
                refused: Some(errno),
            });
            return Err(NftError::Batch {
                errno,
                source: io::Error::from_raw_os_error(errno),
            });
        }
        let mut table = s.tables.get(&tx.family).cloned();
        let mut result = Ok(());
        for (index, op) in tx.ops.iter().enumerate() {
            let refused = s
                .refuse
                .as_deref()
                .and_then(|text| matching(tx.family, op, text));
            let outcome = match refused {
                Some(part) => Err((libc::EINVAL, part)),
                None => apply_op(&mut table, tx.family, op).map_err(|e| (e, op.clone())),
            };
            if let Err((errno, refused)) = outcome {
                result = Err(NftError::Op {
                    index,
                    op: describe_op(tx.family, &refused),
                    refused: Box::new(refused),
                    errno,
                    also_failed: 0,
                    source: io::Error::from_raw_os_error(errno),
                });
                break;
            }
        }
        s.log.push(Record {
            tx: tx.clone(),
            refused: result.as_ref().err().and_then(NftError::errno),
        });
        if result.is_ok() {
            match table {
                Some(t) => s.tables.insert(tx.family, t),
                None => s.tables.remove(&tx.family),
            };
        }
        result
    }
}

/// The part of `op` whose nft text contains `text`: the first such element of an element
/// operation, or the whole operation.
fn matching(family: Family, op: &Op, text: &str) -> Option<Op> {
    let matches = |op: &Op| describe_op(family, op).contains(text);
    match op {
        Op::AddElements { set, elements } => elements.iter().find_map(|e| {
            let part = Op::AddElements {
                set: set.clone(),
                elements: vec![e.clone()].into(),
            };
            matches(&part).then_some(part)
        }),
        _ => matches(op).then(|| op.clone()),
    }
}

/// `table` as the netlink backend reads it back.
pub fn table_state(table: &Table) -> TableState {
    TableState::read_back(table)
}

impl NftKernel for FakeKernel {
    fn read_table(&mut self, family: Family) -> Result<Option<TableState>, NftError> {
        let mut s = self.lock();
        s.reads += 1;
        if let Some(&errno) = s.broken.get(&family) {
            return Err(NftError::Request {
                request: "dump",
                errno,
                source: io::Error::from_raw_os_error(errno),
            });
        }
        Ok(s.tables.get(&family).map(table_state))
    }

    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NftError> {
        if tx.is_empty() {
            return Ok(ApplyStats::default());
        }
        self.commit(tx)?;
        Ok(ApplyStats {
            messages: tx.ops.len() + 2,
            bytes: 0,
        })
    }

    fn apply_all(
        &mut self,
        txs: Vec<Transaction>,
        committed: &mut dyn FnMut(&Transaction),
    ) -> Result<ApplyStats, NftError> {
        let mut total = ApplyStats::default();
        for tx in txs.iter().filter(|tx| !tx.is_empty()) {
            let s = self.apply(tx)?;
            total.messages += s.messages;
            committed(tx);
        }
        Ok(total)
    }
}

/// The sets and chains a rule refers to.
fn rule_refs(rule: &Rule) -> (Vec<&str>, Option<&str>) {
    let mut sets: Vec<&str> = rule
        .matches
        .iter()
        .filter_map(|m| match m {
            Match::DaddrInSet { set }
            | Match::SaddrInSet { set }
            | Match::SaddrDaddrInSet { set }
            | Match::AddrProtoPortInSet { set }
            | Match::ProtoPortInSet { set }
            | Match::AddrProtoInSet { set }
            | Match::CtOriginalAddrProtoPortInSet { set }
            | Match::CtOriginalProtoPortInSet { set } => Some(set.as_str()),
            _ => None,
        })
        .collect();
    let mut chain = None;
    match &rule.action {
        Action::Verdict(v) => chain = v.target(),
        Action::VmapAddrProtoPort { map } | Action::VmapProtoPort { map } => sets.push(map),
        Action::UpdateSaddr { set } => sets.push(set),
        Action::DnatRegion { map, .. } => sets.push(map),
        Action::DnatIndexed { map, .. } => sets.push(map),
        Action::SetDaddr { map, .. } | Action::SetDport { map } => sets.push(map),
        Action::DnatShared {
            addresses, ports, ..
        } => sets.extend([*addresses, *ports]),
        Action::DnatAffinity { map } | Action::UpdateAffinity { map, .. } => sets.push(map),
        _ => {}
    }
    (sets, chain)
}

/// The chains that rules (outside chain `except`) and verdict-map elements of `table` lead
/// to.
fn referenced_chains(table: &Table, except: &str) -> BTreeSet<String> {
    let by_rules = table
        .chains
        .iter()
        .filter(|(name, _)| &***name != except)
        .flat_map(|(_, c)| c.rules.iter())
        .filter_map(|r| rule_refs(r).1);
    let by_elements = table
        .sets
        .values()
        .flat_map(|s| s.elements.iter())
        .filter_map(|(_, v)| match v {
            Some(Value::Verdict(v)) => v.target().map(str::to_string),
            _ => None,
        });
    by_rules.map(str::to_string).chain(by_elements).collect()
}

/// Whether interval `key` overlaps an interval of `elements` (adjacent ones do not).
fn overlaps(elements: &ElementMap, key: &Key) -> bool {
    let Key::Interval { at, end } = *key else {
        return false;
    };
    elements.keys().any(|k| match k {
        Key::Interval { at: a, end: e } => a < end && at < e,
        _ => false,
    })
}

/// Whether two declarations differ in what the kernel compares when a set is re-added (its
/// key and data types and flags; not its size or comment).
fn same_set_type(a: &SetDecl, b: &SetDecl) -> bool {
    a.key == b.key && a.is_vmap == b.is_vmap && a.timeout_secs.is_some() == b.timeout_secs.is_some()
}

/// Applies one operation to `table`, or returns the errno the kernel answers it with.
fn apply_op(table: &mut Option<Table>, family: Family, op: &Op) -> Result<(), i32> {
    use libc::{EBUSY, EEXIST, ENOENT};
    if let Op::AddTable = op {
        table.get_or_insert_with(|| Table::new(family));
        return Ok(());
    }
    let Some(t) = table.as_mut() else {
        return Err(ENOENT);
    };
    match op {
        Op::AddTable => {}
        Op::DeleteTable => *table = None,
        Op::AddChain {
            name,
            base,
            comment,
            ..
        } => match t.chains.get(name) {
            // A regular chain cannot become a base chain, nor a base chain change its hook,
            // type or priority (without a hook, a base chain is left as it is).
            Some(c) if base.is_some() && c.base != *base => return Err(libc::EOPNOTSUPP),
            // The kernel keeps the chain, its rules and its first comment.
            Some(_) => {}
            None => {
                let chain = Chain {
                    base: *base,
                    comment: comment.clone(),
                    rules: Arc::default(),
                };
                t.chains.insert(name.clone(), chain);
            }
        },
        Op::FlushChain { name } => {
            let chain = t.chains.get_mut(name).ok_or(ENOENT)?;
            chain.rules = Arc::default();
        }
        Op::DeleteChain { name } => {
            if !t.chains.contains_key(name) {
                return Err(ENOENT);
            }
            // Its own rules go with it; a reference from elsewhere keeps it.
            if referenced_chains(t, name).contains(&**name) {
                return Err(EBUSY);
            }
            t.chains.remove(name);
        }
        Op::AddRules { chain, rules } => {
            if !t.chains.contains_key(chain) {
                return Err(ENOENT);
            }
            for rule in rules.iter() {
                let (sets, target) = rule_refs(rule);
                let dangling_set = sets.iter().any(|s| !t.sets.contains_key(*s));
                let dangling_chain = target.is_some_and(|c| !t.chains.contains_key(c));
                if dangling_set || dangling_chain {
                    return Err(ENOENT);
                }
            }
            let c = t.chains.get_mut(chain).ok_or(ENOENT)?;
            Arc::make_mut(&mut c.rules).extend(rules.iter().cloned());
        }
        Op::AddSet { name, decl } => match t.sets.get(name) {
            Some(s) if !same_set_type(&s.decl, decl) => return Err(EEXIST),
            Some(_) => {}
            None => {
                let set = Set::new(decl.clone(), ElementMap::new());
                t.sets.insert(name.clone(), set);
            }
        },
        Op::DeleteSet { name } => {
            if !t.sets.contains_key(name) {
                return Err(ENOENT);
            }
            let used = t
                .chains
                .values()
                .flat_map(|c| c.rules.iter())
                .any(|r| rule_refs(r).0.contains(&name.as_str()));
            if used {
                return Err(EBUSY);
            }
            t.sets.remove(name);
        }
        Op::AddElements { set, elements } => {
            for (_, value) in elements.iter() {
                let target = value
                    .as_ref()
                    .and_then(Value::verdict)
                    .and_then(|v| v.target());
                if target.is_some_and(|c| !t.chains.contains_key(c)) {
                    return Err(ENOENT);
                }
            }
            let s = t.sets.get_mut(set).ok_or(ENOENT)?;
            for (key, value) in elements.iter() {
                match s.elements.get(&key) {
                    Some(have) if have != value => return Err(EEXIST),
                    Some(_) => {}
                    None if overlaps(&s.elements, &key) => return Err(EEXIST),
                    None => {
                        s.elements_mut().insert(key, value);
                    }
                }
            }
        }
        Op::DeleteElements { set, keys } => {
            let s = t.sets.get_mut(set).ok_or(ENOENT)?;
            for key in keys {
                s.elements_mut().remove(key).ok_or(ENOENT)?;
            }
        }
    }
    Ok(())
}

#[doc(hidden)] // Shared with the kernel test suite.
#[path = "fake_cases.rs"]
pub mod cases;

#[cfg(test)]
#[path = "fake_tests.rs"]
mod tests;
