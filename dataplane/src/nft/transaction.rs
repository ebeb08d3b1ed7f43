//! A transaction: the operations one atomic nf_tables batch applies to table `nftproxy` of a
//! family.

use std::sync::Arc;

use crate::nft::ruleset::{BaseChain, ChainName, Family, Key, Rule, SetDecl, Value};

/// One nftables operation inside a transaction on table `nftproxy` of the transaction's family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    AddTable,
    DeleteTable,
    /// Create a chain (a no-op for the kernel if it exists). The rules that follow in the same
    /// transaction give it the content `fingerprint` describes.
    AddChain {
        name: ChainName,
        base: Option<BaseChain>,
        comment: Option<Arc<str>>,
        fingerprint: u64,
    },
    FlushChain {
        name: ChainName,
    },
    DeleteChain {
        name: ChainName,
    },
    /// Append rules to a chain (one message per rule).
    AddRules {
        chain: ChainName,
        rules: Arc<Vec<Rule>>,
    },
    AddSet {
        name: String,
        decl: SetDecl,
    },
    DeleteSet {
        name: String,
    },
    AddElements {
        set: String,
        elements: Vec<(Key, Option<Value>)>,
    },
    DeleteElements {
        set: String,
        keys: Vec<Key>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transaction {
    pub family: Family,
    pub ops: Vec<Op>,
}

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}
