//! `iptables-restore --noflush` input: a full restore of every chain of ours, or a partial one
//! that touches only what changed since the last successful restore (see the module
//! documentation of [`crate::iptables`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::save::{jump_target, parse_save, tokens};
use super::{ChainKind, IptChain, IptRuleset, IptTable, JumpRule, PREFIX, Tables};

/// One `iptables-restore` input and what it does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restore {
    pub text: String,
    pub full: bool,
    /// `-A` and `-I` lines per table (kube-proxy's `sync_proxy_rules_iptables_last`).
    pub rules_written: BTreeMap<IptTable, usize>,
    /// Chains declared (created or flushed).
    pub chains_written: usize,
    /// Chains deleted (`-X`).
    pub chains_deleted: usize,
}

impl Restore {
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    pub fn lines(&self) -> usize {
        self.text.lines().count()
    }
}

/// The commands for one table, in the order they must run.
#[derive(Default)]
struct TableCommands {
    declare: Vec<String>,
    delete_rules: Vec<String>,
    insert: Vec<String>,
    append: Vec<String>,
    remove_chains: Vec<String>,
}

impl TableCommands {
    fn is_empty(&self) -> bool {
        self.declare.is_empty()
            && self.delete_rules.is_empty()
            && self.insert.is_empty()
            && self.append.is_empty()
            && self.remove_chains.is_empty()
    }

    fn append_chain(&mut self, name: &str, chain: &IptChain) {
        self.declare.push(name.to_string());
        for rule in &chain.rules {
            self.append.push(format!("-A {name} {rule}"));
        }
    }

    fn render(&self, table: IptTable, out: &mut Restore) {
        if self.is_empty() {
            return;
        }
        let t = &mut out.text;
        let _ = writeln!(t, "*{}", table.name());
        for c in &self.declare {
            let _ = writeln!(t, ":{c} - [0:0]");
        }
        for line in self
            .delete_rules
            .iter()
            .chain(&self.insert)
            .chain(&self.append)
        {
            t.push_str(line);
            t.push('\n');
        }
        for c in &self.remove_chains {
            let _ = writeln!(t, "-X {c}");
        }
        t.push_str("COMMIT\n");
        out.rules_written
            .insert(table, self.insert.len() + self.append.len());
        out.chains_written += self.declare.len();
        out.chains_deleted += self.remove_chains.len();
    }
}

/// What a full restore needs to know about the kernel: our chains and jump rules that exist.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Existing {
    pub chains: BTreeMap<IptTable, BTreeSet<String>>,
    /// Rules in built-in chains that jump to one of our chains: (built-in chain, spec as saved).
    pub jumps: BTreeMap<IptTable, Vec<(String, String)>>,
}

impl Existing {
    /// Our chains and jumps in `iptables-save` output (of any tables).
    pub fn from_save(text: &str) -> Existing {
        let saved = parse_save(text);
        let mut out = Existing::default();
        for table in IptTable::ALL {
            let Some(t) = saved.get(table.name()) else {
                continue;
            };
            out.chains.insert(
                table,
                t.chains
                    .iter()
                    .filter(|c| c.starts_with(PREFIX) && !t.builtins.contains(*c))
                    .cloned()
                    .collect(),
            );
            out.jumps.insert(
                table,
                t.rules
                    .iter()
                    .filter(|(chain, spec)| {
                        t.builtins.contains(chain)
                            && jump_target(spec).is_some_and(|j| j.starts_with(PREFIX))
                    })
                    .cloned()
                    .collect(),
            );
        }
        out
    }
}

/// Rewrites all of nftproxy's rules: declares (flushes) and refills every chain, deletes our
/// chains that are no longer wanted and brings the jump rules of the built-in chains in order.
pub fn plan_full(desired: &IptRuleset, existing: &Existing) -> Restore {
    let mut out = Restore {
        full: true,
        ..Restore::default()
    };
    for table in IptTable::ALL {
        let mut cmd = TableCommands::default();
        let empty = BTreeMap::new();
        let chains = desired.tables.get(&table).unwrap_or(&empty);
        for (name, chain) in chains {
            cmd.append_chain(name, chain);
        }
        if let Some(have) = existing.chains.get(&table) {
            for stale in have.iter().filter(|c| !chains.contains_key(*c)) {
                cmd.declare.push(stale.clone());
                cmd.remove_chains.push(stale.clone());
            }
        }
        // Jump rules: keep one copy of each wanted rule, delete the rest (duplicates, old
        // shapes, jumps to chains no longer wanted), insert what is missing.
        let mut wanted: Vec<&JumpRule> =
            desired.jumps.iter().filter(|j| j.table == table).collect();
        for (builtin, spec) in existing.jumps.get(&table).into_iter().flatten() {
            let have = tokens(spec);
            match wanted
                .iter()
                .position(|j| j.builtin == builtin.as_str() && tokens(&j.spec) == have)
            {
                Some(i) => {
                    wanted.remove(i);
                }
                None => cmd.delete_rules.push(format!("-D {builtin} {spec}")),
            }
        }
        for j in wanted {
            cmd.insert.push(format!("-I {} 1 {}", j.builtin, j.spec));
        }
        cmd.render(table, &mut out);
    }
    out
}

/// Takes the chains from `written` (what the last successful restore left) to `desired`,
/// touching only what changed. An empty restore means nothing changed.
pub fn plan_partial(written: &Tables, desired: &IptRuleset) -> Restore {
    let mut out = Restore::default();
    let empty = BTreeMap::new();
    for table in IptTable::ALL {
        let mut cmd = TableCommands::default();
        let want = desired.tables.get(&table).unwrap_or(&empty);
        let have = written.get(&table).unwrap_or(&empty);
        for (name, chain) in want {
            let Some(old) = have.get(name) else {
                cmd.append_chain(name, chain);
                continue;
            };
            if old == chain {
                continue;
            }
            let (old_body, old_tail) = old.split();
            let (new_body, new_tail) = chain.split();
            let editable = matches!(chain.kind, ChainKind::Dispatch { .. })
                && old.kind == chain.kind
                && old_tail == new_tail;
            if !editable {
                cmd.append_chain(name, chain);
                continue;
            }
            let (removed, added) = multiset_diff(old_body, new_body);
            for rule in removed {
                cmd.delete_rules.push(format!("-D {name} {rule}"));
            }
            for rule in added {
                cmd.insert.push(format!("-I {name} 1 {rule}"));
            }
        }
        for name in have.keys().filter(|n| !want.contains_key(*n)) {
            cmd.declare.push(name.clone());
            cmd.remove_chains.push(name.clone());
        }
        cmd.render(table, &mut out);
    }
    out
}

/// Rules of `old` missing from `new` and rules of `new` missing from `old`, duplicates counted.
fn multiset_diff<'a>(old: &'a [String], new: &'a [String]) -> (Vec<&'a String>, Vec<&'a String>) {
    let mut count: BTreeMap<&String, i64> = BTreeMap::new();
    for r in old {
        *count.entry(r).or_default() += 1;
    }
    for r in new {
        *count.entry(r).or_default() -= 1;
    }
    let mut removed = Vec::new();
    let mut added = Vec::new();
    for (rule, n) in count {
        for _ in 0..n.max(0) {
            removed.push(rule);
        }
        for _ in 0..(-n).max(0) {
            added.push(rule);
        }
    }
    (removed, added)
}
