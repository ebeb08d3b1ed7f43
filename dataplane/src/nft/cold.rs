//! The transaction that creates table `nftproxy` (a cold start), cut into parts of a bounded
//! number of set elements.
//!
//! While any process listens to nf_tables notifications (`nft monitor`, a CNI agent, a
//! monitoring tool), the kernel builds one notification per element of a transaction inside the
//! commit, each in a buffer of its own (about 4 KiB), and holds them all until the commit ends.
//! With the 400k elements of a 30k-Service cold start in one transaction that cost grows faster
//! than the elements. Committing 400k map elements with `nft -f` (kernel 6.18, 2 CPUs), the
//! kernel's system time was 0.8–1.1 s without a listener whatever the split; with one it was
//! 2.0–5.6 s as one transaction, 2.4–2.9 s as two, 1.3–1.5 s as eight and 1.34 s as 32
//! (docs/performance.md, "Live mode"). Smaller parts still help: the buffers of a part of a
//! few thousand elements come from the slabs the previous part freed, where those of 50,000
//! take fresh pages from the page allocator. `run --once` of 30k Services × 5 endpoints with
//! a process reading every notification took 1.40 s in parts of 50,000 elements, 1.29 s in
//! parts of 10,000 and 1.20–1.23 s in parts of 250 to 5,000, against 1.05 s with no listener.
//! What remains, about 0.8 µs per notified element, no split removes.
//!
//! Parts are not free either: every commit walks every chain of every table in the namespace,
//! so with another program's table of 30,000 chains beside ours the same cold start took
//! 1.05 s in parts of 50,000 and 1.13–1.23 s in parts of 2,000 (docs/performance.md, "Smaller
//! cold-start parts"). So the parts are small ([`ELEMENTS_PER_STAGE_HEARD`]) only while
//! another process listens, and large otherwise ([`ELEMENTS_PER_STAGE`]). Parts also let the
//! encoder work on the next part while the kernel commits the current one.

use std::collections::HashSet;

use super::ruleset::ChainName;
use super::state::TableState;
use super::transaction::{Op, Transaction};

/// Set elements per transaction when [`split_cold_elements`] cuts one.
pub const ELEMENTS_PER_STAGE: usize = 50_000;

/// Set elements per transaction while another process listens to nf_tables notifications.
pub const ELEMENTS_PER_STAGE_HEARD: usize = 2_000;

/// When the table does not exist yet (`current` is `None`), moves the set elements of `parts`
/// (the planner's transaction, possibly split already by `plan::split_new_chains`) into
/// transactions of at most `per_part` elements, after a first one that creates the table, its
/// sets and its chains and writes the rules of its regular chains, and before the ones with
/// the base chains' rules.
///
/// Nothing in the new table is reachable before the last part: its base chains are created
/// empty (they accept everything), and the rules of base chains stay in the last part. So a
/// cold start still shows no Service until the last part commits, and a part that fails
/// leaves a table that does nothing, which the next sync reads back and completes.
///
/// The regular chains' rules come before the elements because a rule that looks a map up
/// makes the kernel walk every element the map holds already (`nf_tables_bind_check_setelem`,
/// once per chain using the map); an element added to a map in use is only checked against
/// its few rules. With the rules last, those walks were a third of the kernel's time in a
/// cold start at 100k Services (docs/performance.md, "Cold full sync now").
///
/// Anything but additions (a table that exists, deletions, flushes) is left as it is: there,
/// elements committed early would change what traffic sees before the rest of the change.
pub fn split_cold_elements(
    current: Option<&TableState>,
    parts: Vec<Transaction>,
    per_part: usize,
) -> Vec<Transaction> {
    // A table that exists is never split; most syncs stop here without walking their ops.
    if current.is_some() {
        return parts;
    }
    let only_additions = parts.iter().flat_map(|t| &t.ops).all(|op| {
        matches!(
            op,
            Op::AddTable
                | Op::AddSet { .. }
                | Op::AddChain { .. }
                | Op::AddRules { .. }
                | Op::AddElements { .. }
        )
    });
    let elements: usize = parts
        .iter()
        .flat_map(|t| &t.ops)
        .map(|op| match op {
            Op::AddElements { elements, .. } => elements.len(),
            _ => 0,
        })
        .sum();
    let Some(family) = parts.first().map(|t| t.family) else {
        return parts;
    };
    if !only_additions || elements <= per_part.max(1) {
        return parts;
    }
    let base_chains: HashSet<ChainName> = parts
        .iter()
        .flat_map(|t| &t.ops)
        .filter_map(|op| match op {
            Op::AddChain {
                name,
                base: Some(_),
                ..
            } => Some(name.clone()),
            _ => None,
        })
        .collect();
    let part = |ops| Transaction { family, ops };
    let mut setup = Vec::new();
    let mut inner_rules = Vec::new();
    let mut chunks = vec![part(Vec::new())];
    let mut in_chunk = 0;
    let mut rest = Vec::new();
    for tx in parts {
        let mut rules = Vec::new();
        for op in tx.ops {
            match op {
                Op::AddTable | Op::AddSet { .. } | Op::AddChain { .. } => setup.push(op),
                Op::AddRules { ref chain, .. } if !base_chains.contains(chain) => {
                    inner_rules.push(op)
                }
                Op::AddElements { set, mut elements } => {
                    while !elements.is_empty() {
                        if in_chunk == per_part.max(1) {
                            chunks.push(part(Vec::new()));
                            in_chunk = 0;
                        }
                        let take = elements.len().min(per_part.max(1) - in_chunk);
                        let tail = elements.split_off(take);
                        in_chunk += elements.len();
                        chunks
                            .last_mut()
                            .expect("never empty")
                            .ops
                            .push(Op::AddElements {
                                set: set.clone(),
                                elements,
                            });
                        elements = tail;
                    }
                }
                other => rules.push(other),
            }
        }
        rest.push(part(rules));
    }
    setup.extend(inner_rules);
    let mut out = vec![part(setup)];
    out.extend(chunks);
    out.extend(rest);
    out.retain(|t| !t.is_empty());
    out
}

#[cfg(test)]
#[path = "cold_tests.rs"]
mod tests;
