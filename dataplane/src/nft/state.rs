//! What the kernel holds for a family's table, as far as planning needs to know: kept after each
//! commit, or read back from the kernel.
//!
//! The state is thin: it records what only the kernel knows (which chains exist with which
//! fingerprint and endpoint-map region, which sets with which declaration), not the sets'
//! elements. After our own commit every set holds the elements of the desired table it was
//! committed from ([`Elements::Desired`]), which the agent keeps anyway; the next plan finds
//! them there, or in the changes the desired table made since (see
//! [`crate::nft::desired::Before`]). Copying them into the state held the table's elements
//! twice (about 20 MiB at 30k Services) and took a noticeable share of every cold sync.
//! Only a state read back from the kernel carries elements ([`Elements::Read`]), for the one
//! full plan that follows it.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::nft::regions::Region;
use crate::nft::render;
use crate::nft::ruleset::{
    Action, BaseChain, Chain, ChainName, ElementMap, Rule, SetDecl, Table, endpoint_map_index,
    region_at,
};
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
    /// give the chain the same region again (see [`crate::nft::regions`]).
    pub region: Option<Region>,
}

/// What the state knows of a set's elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Elements {
    /// Those of the desired table the state was last committed from (the planner is told where
    /// to find them: [`crate::nft::desired::Before`]).
    Desired,
    /// Read back from the kernel: held for the full plan that follows the read, then dropped
    /// ([`TableState::settle`]).
    Read(ElementMap),
}

impl Elements {
    /// The elements read back, if these were.
    pub fn read(&self) -> Option<&ElementMap> {
        match self {
            Elements::Read(elements) => Some(elements),
            Elements::Desired => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetState {
    pub decl: SetDecl,
    pub elements: Elements,
}

/// What the kernel holds for one family's `nftproxy` table.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TableState {
    pub chains: BTreeMap<ChainName, ChainState>,
    pub sets: BTreeMap<String, SetState>,
}

impl TableState {
    /// The state the kernel is in right after `tx`, planned against `self` for a desired
    /// table, committed successfully on top of it. Element operations change nothing: every
    /// set then holds the desired table's elements ([`TableState::settle`] marks the sets read
    /// back so before the commit).
    pub fn apply(&mut self, tx: &Transaction) {
        for op in &tx.ops {
            self.apply_op(op);
        }
    }

    /// Marks every set as holding the desired table's elements, dropping the elements read
    /// back: called once the transaction taking the kernel to the desired table is planned
    /// (if it fails, the state is forgotten and read back again).
    pub fn settle(&mut self) {
        for set in self.sets.values_mut() {
            set.elements = Elements::Desired;
        }
    }

    /// Whether `read`, read back from the kernel, is what this state says the kernel holds,
    /// `table` being the desired table the state was committed from.
    pub fn agrees_with(&self, read: &TableState, table: &Table) -> bool {
        self.chains == read.chains
            && self.sets.len() == read.sets.len()
            && self.sets.iter().zip(&read.sets).all(|((name, s), (n, r))| {
                name == n
                    && s.decl == r.decl
                    && match (&s.elements, &r.elements) {
                        (Elements::Desired, Elements::Read(read)) => table
                            .sets
                            .get(name)
                            .map_or(read.is_empty(), |t| *t.elements == *read),
                        (a, b) => a == b,
                    }
            })
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
                    region: None,
                });
                entry.fingerprint = Some(*fingerprint);
            }
            Op::FlushChain { name } => {
                if let Some(c) = self.chains.get_mut(name) {
                    c.empty = true;
                    c.region = None;
                }
            }
            Op::DeleteChain { name } => {
                self.chains.remove(name);
            }
            Op::AddRules { chain, rules } => {
                if let Some(c) = self.chains.get_mut(chain) {
                    c.empty &= rules.is_empty();
                    c.region = c.region.or(dnat_region(rules));
                }
            }
            Op::AddSet { name, decl } => {
                self.sets.entry(name.clone()).or_insert(SetState {
                    decl: decl.clone(),
                    elements: Elements::Desired,
                });
            }
            Op::DeleteSet { name } => {
                self.sets.remove(name);
            }
            Op::AddElements { .. } | Op::DeleteElements { .. } => {}
        }
    }
}

/// The endpoint-map region the first `DnatRegion` rule of `rules` uses.
pub fn dnat_region(rules: &[Rule]) -> Option<Region> {
    rules.iter().find_map(|r| match &r.action {
        Action::DnatRegion { map, offset } => Some(Region {
            map: endpoint_map_index(map)?,
            region: region_at(*offset),
        }),
        _ => None,
    })
}

/// Content fingerprint of a chain: its hook and its rules as nft text. The comment is not part
/// of it: comments derive from the chain's name, and the kernel keeps a chain's first comment.
pub fn fingerprint(chain: &Chain) -> u64 {
    let mut h = Sha256::new();
    h.update(format!(
        "{:?}
",
        chain.base
    ));
    for rule in chain.rules.iter() {
        h.update(render::rule_text(rule));
        h.update(
            b"
",
        );
    }
    let digest = h.finalize();
    u64::from_be_bytes(digest[..8].try_into().expect("sha256 is 32 bytes"))
}

impl TableState {
    /// What reading `table` back from the kernel gives: its chains fingerprinted from their
    /// rules, its sets with their elements, except those of dynamic sets (timeouts), which
    /// the datapath fills and which are not read back.
    pub fn read_back(table: &Table) -> TableState {
        let chains = table.chains.iter().map(|(name, c)| {
            let state = ChainState {
                base: c.base,
                fingerprint: Some(fingerprint(c)),
                empty: c.rules.is_empty(),
                region: dnat_region(&c.rules),
            };
            (name.clone(), state)
        });
        let sets = table.sets.iter().map(|(name, s)| {
            let elements = match s.decl.timeout_secs {
                Some(_) => ElementMap::new(),
                None => (*s.elements).clone(),
            };
            let state = SetState {
                decl: s.decl.clone(),
                elements: Elements::Read(elements),
            };
            (name.clone(), state)
        });
        TableState {
            chains: chains.collect(),
            sets: sets.collect(),
        }
    }
}
