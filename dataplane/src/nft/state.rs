//! What the kernel holds for a family's table, as far as planning needs to know: kept after each
//! commit, or read back from the kernel.

use std::collections::BTreeMap;

use crate::nft::ruleset::{
    Action, BaseChain, ChainName, Key, Rule, SetDecl, Table, Value, endpoint_map_index, slot_region,
};
use crate::nft::slots::Slot;
use crate::nft::transaction::{Op, Transaction};

/// What the kernel holds for one chain, as far as planning needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainState {
    pub base: Option<BaseChain>,
    /// Fingerprint of the rules as written by nftproxy; `None` if unreadable (forces a rewrite).
    pub fingerprint: Option<u64>,
    /// Whether the chain holds no rules (stale chains are emptied before they are deleted).
    pub empty: bool,
    /// The endpoint-map region the chain's rules DNAT through, so that a restarted agent can
    /// give the chain the same region again (see [`crate::nft::slots`]).
    pub slot: Option<Slot>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetState {
    pub decl: SetDecl,
    pub elements: BTreeMap<Key, Option<Value>>,
}

/// What the kernel holds for one family's `nftproxy` table.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TableState {
    pub chains: BTreeMap<ChainName, ChainState>,
    pub sets: BTreeMap<String, SetState>,
}

impl TableState {
    /// The state the kernel is in right after `tx` committed successfully on top of `self`.
    pub fn apply(&mut self, tx: &Transaction) {
        for op in &tx.ops {
            self.apply_op(op);
        }
    }

    /// [`TableState::apply`] without the element operations, for the transactions of a
    /// [`plan`] of the whole table; [`TableState::copy_elements`] completes the state once all
    /// of them have committed.
    pub fn apply_except_elements(&mut self, tx: &Transaction) {
        for op in &tx.ops {
            if !matches!(op, Op::AddElements { .. } | Op::DeleteElements { .. }) {
                self.apply_op(op);
            }
        }
    }

    /// Gives every set `desired`'s elements, which is what a [`plan`] of the whole table leaves
    /// them at. The copy keeps `desired`'s dense B-tree layout; inserting the elements one by
    /// one, in key order, would leave the nodes half full.
    pub fn copy_elements(&mut self, desired: &Table) {
        for (name, set) in &desired.sets {
            if let Some(s) = self.sets.get_mut(name) {
                s.elements = set.elements.clone();
            }
        }
    }

    fn apply_op(&mut self, op: &Op) {
        match op {
            Op::AddTable => {}
            Op::DeleteTable => *self = TableState::default(),
            Op::AddChain {
                name,
                base,
                fingerprint,
                ..
            } => {
                let entry = self.chains.entry(name.clone()).or_insert(ChainState {
                    base: *base,
                    fingerprint: None,
                    empty: true,
                    slot: None,
                });
                entry.fingerprint = Some(*fingerprint);
            }
            Op::FlushChain { name } => {
                if let Some(c) = self.chains.get_mut(name) {
                    c.empty = true;
                    c.slot = None;
                }
            }
            Op::DeleteChain { name } => {
                self.chains.remove(name);
            }
            Op::AddRules { chain, rules } => {
                if let Some(c) = self.chains.get_mut(chain) {
                    c.empty &= rules.is_empty();
                    c.slot = c.slot.or(dnat_slot(rules));
                }
            }
            Op::AddSet { name, decl } => {
                self.sets.entry(name.clone()).or_insert(SetState {
                    decl: decl.clone(),
                    elements: BTreeMap::new(),
                });
            }
            Op::DeleteSet { name } => {
                self.sets.remove(name);
            }
            Op::AddElements { set, elements } => {
                if let Some(s) = self.sets.get_mut(set) {
                    for (k, v) in elements {
                        s.elements.insert(*k, v.clone());
                    }
                }
            }
            Op::DeleteElements { set, keys } => {
                if let Some(s) = self.sets.get_mut(set) {
                    for k in keys {
                        s.elements.remove(k);
                    }
                }
            }
        }
    }
}

/// The endpoint-map region the first `DnatSlot` rule of `rules` uses.
pub fn dnat_slot(rules: &[Rule]) -> Option<Slot> {
    rules.iter().find_map(|r| match &r.action {
        Action::DnatSlot { map, offset } => Some(Slot {
            map: endpoint_map_index(map)?,
            region: slot_region(*offset),
        }),
        _ => None,
    })
}
