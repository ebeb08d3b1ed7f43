//! Reading `iptables-save` output: tables, chains and rules, the targets of jump rules, and
//! the removal of chains by owner (`nftproxy cleanup`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// One table of `iptables-save` output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    /// Every chain, built-in ones included.
    pub chains: BTreeSet<String>,
    pub builtins: BTreeSet<String>,
    /// `(chain, spec)` of every `-A chain spec` line, in order.
    pub rules: Vec<(String, String)>,
}

/// Parses `iptables-save` output into its tables (by name).
pub fn parse_save(text: &str) -> BTreeMap<String, SavedTable> {
    let mut out: BTreeMap<String, SavedTable> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if let Some(name) = line.strip_prefix('*') {
            current = Some(name.to_string());
            out.entry(name.to_string()).or_default();
            continue;
        }
        let Some(table) = current.as_ref().and_then(|t| out.get_mut(t)) else {
            continue;
        };
        if let Some(decl) = line.strip_prefix(':') {
            let mut parts = decl.split_whitespace();
            if let Some(chain) = parts.next() {
                table.chains.insert(chain.to_string());
                if parts.next().is_some_and(|policy| policy != "-") {
                    table.builtins.insert(chain.to_string());
                }
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let (chain, spec) = rule.split_once(' ').unwrap_or((rule, ""));
            table.rules.push((chain.to_string(), spec.to_string()));
        } else if line == "COMMIT" {
            current = None;
        }
    }
    out
}

/// Splits a rule specification into arguments, honouring double quotes (which are dropped).
pub fn tokens(spec: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut any = false;
    let mut chars = spec.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            '\\' if quoted => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            c if c.is_whitespace() && !quoted => {
                if any || !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            c => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The `-j`/`-g` target of a rule specification.
pub fn jump_target(spec: &str) -> Option<String> {
    let t = tokens(spec);
    t.iter()
        .position(|a| matches!(a.as_str(), "-j" | "-g" | "--jump" | "--goto"))
        .and_then(|i| t.get(i + 1).cloned())
}

/// Restore input that deletes the chains `remove` selects from `saved` tables: the rules of
/// built-in chains that jump to them are deleted, the chains flushed, then deleted. A chain
/// still referenced from a chain that stays is kept (with what it refers to), so the restore
/// cannot fail on a reference count. Returns the text (empty if nothing is to be done) and
/// the deleted chains as `table/chain`.
pub fn plan_removal(
    saved: &BTreeMap<String, SavedTable>,
    remove: impl Fn(&str) -> bool,
) -> (String, Vec<String>) {
    let mut text = String::new();
    let mut removed = Vec::new();
    for (name, table) in saved {
        let mut doomed: BTreeSet<String> = table
            .chains
            .iter()
            .filter(|c| !table.builtins.contains(*c) && remove(c))
            .cloned()
            .collect();
        // Chains referenced from a chain that stays must stay too, and so on.
        loop {
            let keep: BTreeSet<String> = table
                .rules
                .iter()
                .filter(|(chain, _)| !table.builtins.contains(chain) && !doomed.contains(chain))
                .filter_map(|(_, spec)| jump_target(spec))
                .filter(|t| doomed.contains(t))
                .collect();
            if keep.is_empty() {
                break;
            }
            doomed.retain(|d| !keep.contains(d));
        }
        if doomed.is_empty() {
            continue;
        }
        let _ = writeln!(text, "*{name}");
        for c in &doomed {
            let _ = writeln!(text, ":{c} - [0:0]");
        }
        for (chain, spec) in &table.rules {
            if table.builtins.contains(chain)
                && jump_target(spec).is_some_and(|t| doomed.contains(&t))
            {
                let _ = writeln!(text, "-D {chain} {spec}");
            }
        }
        for c in &doomed {
            let _ = writeln!(text, "-X {c}");
            removed.push(format!("{name}/{c}"));
        }
        text.push_str("COMMIT\n");
    }
    (text, removed)
}
