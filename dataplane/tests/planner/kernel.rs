//! A strict model kernel and the sync steps the tests take against it.

use super::*;

/// A strict model of table `nftproxy` in the kernel, elements included: it refuses what
/// nf_tables refuses (rules in missing chains, rules, elements and verdicts naming missing
/// sets or chains, an element added again with other data, deleting a missing element, a chain
/// with rules or one something still jumps to, a set a rule still uses). The planner's own
/// [`TableState`] is thin (no elements), so it cannot serve as the kernel here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kernel {
    pub table: Option<Table>,
}

/// The sets (`@name`) and chains (`jump`/`goto name`) nft text refers to.
pub fn references(text: &str) -> (Vec<String>, Vec<String>) {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == ',' || c == '{' || c == '}' || c == ':')
        .filter(|w| !w.is_empty())
        .collect();
    let sets = words
        .iter()
        .filter_map(|w| w.strip_prefix('@'))
        .map(str::to_string)
        .collect();
    let chains = words
        .windows(2)
        .filter(|w| w[0] == "jump" || w[0] == "goto")
        .map(|w| w[1].to_string())
        .collect();
    (sets, chains)
}

pub fn value_chain(v: Option<&Value>) -> Option<&str> {
    match v {
        Some(Value::Verdict(Verdict::Jump(c) | Verdict::Goto(c))) => Some(c),
        _ => None,
    }
}

impl Kernel {
    pub fn table(&mut self) -> &mut Table {
        self.table.as_mut().expect("ENOENT: no table")
    }

    /// Applies `tx` as nf_tables would, panicking where it would refuse it.
    pub fn apply(&mut self, tx: &Transaction) {
        for op in &tx.ops {
            self.apply_op(op);
        }
    }

    pub fn apply_op(&mut self, op: &Op) {
        match op {
            Op::AddTable => {
                self.table.get_or_insert_with(|| Table::new(Family::V4));
            }
            Op::DeleteTable => self.table = None,
            Op::AddChain { name, base, .. } => {
                let t = self.table();
                match t.chains.get(name) {
                    Some(c) => assert_eq!(&c.base, base, "EEXIST: chain {name} hook changed"),
                    None => {
                        t.chains.insert(
                            name.clone(),
                            Chain {
                                base: *base,
                                comment: None,
                                rules: Arc::new(Vec::new()),
                            },
                        );
                    }
                }
            }
            Op::FlushChain { name } => {
                let c = self.table().chains.get_mut(name);
                c.unwrap_or_else(|| panic!("ENOENT: flush chain {name}"))
                    .rules = Arc::new(Vec::new());
            }
            Op::DeleteChain { name } => {
                let t = self.table();
                let c = t
                    .chains
                    .get(name)
                    .unwrap_or_else(|| panic!("ENOENT: chain {name}"));
                assert!(c.rules.is_empty(), "EBUSY: chain {name} has rules");
                let jumped = t.chains.values().flat_map(|c| c.rules.iter()).any(|r| {
                    references(&render::rule_text(r))
                        .1
                        .iter()
                        .any(|c| c == &**name)
                });
                let mapped = t
                    .sets
                    .values()
                    .flat_map(|s| s.elements.iter())
                    .any(|(_, v)| value_chain(v.as_ref()) == Some(name));
                assert!(!jumped && !mapped, "EBUSY: chain {name} in use");
                t.chains.remove(name);
            }
            Op::AddRules { chain, rules } => {
                let t = self.table();
                for r in rules.iter() {
                    let (sets, chains) = references(&render::rule_text(r));
                    for s in sets {
                        assert!(t.sets.contains_key(&s), "ENOENT: set {s} in {chain}");
                    }
                    for c in chains {
                        assert!(
                            t.chains.contains_key(c.as_str()),
                            "ENOENT: chain {c} in {chain}"
                        );
                    }
                }
                let c = t
                    .chains
                    .get_mut(chain)
                    .unwrap_or_else(|| panic!("ENOENT: add rules to {chain}"));
                Arc::make_mut(&mut c.rules).extend(rules.iter().cloned());
            }
            Op::AddSet { name, decl } => {
                let t = self.table();
                match t.sets.get(name) {
                    Some(s) => assert_eq!(&s.decl, decl, "EEXIST: set {name} declared again"),
                    None => {
                        t.sets.insert(
                            name.clone(),
                            Set {
                                decl: decl.clone(),
                                elements: ElementMap::new().into(),
                            },
                        );
                    }
                }
            }
            Op::DeleteSet { name } => {
                let t = self.table();
                let used = t.chains.values().flat_map(|c| c.rules.iter()).any(|r| {
                    references(&render::rule_text(r))
                        .0
                        .iter()
                        .any(|s| s == name)
                });
                assert!(!used, "EBUSY: set {name} in use");
                assert!(t.sets.remove(name).is_some(), "ENOENT: set {name}");
            }
            Op::AddElements { set, elements } => {
                let t = self.table();
                for (_, v) in elements {
                    if let Some(c) = value_chain(v.as_ref()) {
                        assert!(t.chains.contains_key(c), "ENOENT: chain {c} in @{set}");
                    }
                }
                let s = t
                    .sets
                    .get_mut(set)
                    .unwrap_or_else(|| panic!("ENOENT: elements of {set}"));
                for (k, v) in elements {
                    if let Some(old) = s.elements_mut().insert(k, v.clone()) {
                        assert_eq!(old, v, "EEXIST: {k:?} in {set} with other data");
                    }
                }
            }
            Op::DeleteElements { set, keys } => {
                let s = self
                    .table()
                    .sets
                    .get_mut(set)
                    .unwrap_or_else(|| panic!("ENOENT: elements of {set}"));
                for k in keys {
                    assert!(
                        s.elements_mut().remove(k).is_some(),
                        "ENOENT: {k:?} in {set}"
                    );
                }
            }
        }
    }

    /// What reading the table back gives (elements included).
    pub fn read(&self) -> Option<TableState> {
        self.table.as_ref().map(TableState::read_back)
    }

    /// What the agent keeps after committing the desired table the kernel holds now.
    pub fn thin(&self) -> TableState {
        let mut state = self.read().unwrap_or_default();
        state.settle();
        state
    }
}

/// The kernel's table if `t` had been written from scratch.
pub fn fresh_state(t: &Table) -> Kernel {
    let mut k = Kernel::default();
    k.apply(&plan(None, &Before::Nothing, t));
    k
}

/// Applies plan + cleanup of a whole table after an update that returned `before`, planned
/// against the thin state the agent keeps: it must leave the kernel as a plan against the table
/// read back does.
pub fn step_from(kernel: &mut Kernel, t: &Table, before: &Before) {
    let mut read_back = kernel.clone();
    step(&mut read_back, t);
    let mut state = kernel.thin();
    let tx = plan(Some(&state), before, t);
    kernel.apply(&tx);
    state.apply(&tx);
    kernel.apply(&plan_cleanup(&state, t));
    assert_eq!(kernel, &read_back, "delta and read-back plans differ");
}

/// Applies plan + cleanup, planned against the table read back, like the agent's full syncs.
pub fn step(kernel: &mut Kernel, t: &Table) -> usize {
    let read = kernel.read();
    let tx = plan(read.as_ref(), &Before::Nothing, t);
    kernel.apply(&tx);
    let mut state = read.unwrap_or_default();
    state.settle();
    state.apply(&tx);
    let cleanup = plan_cleanup(&state, t);
    kernel.apply(&cleanup);
    tx.ops.len() + cleanup.ops.len()
}

/// Plans a change confined to `scope` twice, against the thin state the agent keeps (from the
/// changes the update recorded) and against the table read back: both must agree. Applies it.
pub fn step_scope(kernel: &mut Kernel, t: &Table, scope: &Scope) -> Transaction {
    let thin = kernel.thin();
    let tx = plan_scope(&thin, t, scope);
    let read = kernel.read().unwrap_or_default();
    assert_eq!(
        tx,
        plan_scope(&read, t, scope),
        "delta and read-back plans differ"
    );
    kernel.apply(&tx);
    let mut state = thin;
    state.apply(&tx);
    let cleanup = plan_cleanup_scope(&state, t, scope);
    kernel.apply(&cleanup);
    tx
}
