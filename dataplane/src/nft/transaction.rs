//! A transaction: the operations one atomic nf_tables batch applies to table `nftproxy` of a
//! family.

use std::sync::Arc;

use crate::nft::ruleset::{BaseChain, ChainName, ElementMap, Family, Key, Rule, SetDecl, Value};

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
        elements: Elements,
    },
    DeleteElements {
        set: String,
        keys: Vec<Key>,
    },
}

/// The elements one [`Op::AddElements`] adds.
#[derive(Clone, Debug)]
pub enum Elements {
    /// Elements of their own: a change's.
    Listed(Vec<(Key, Option<Value>)>),
    /// `count` elements of a desired set, in key order from key `first`, shared with the desired
    /// table: a whole set added (a cold start's 400k elements) is not copied into the
    /// transaction.
    Shared {
        all: Arc<ElementMap>,
        first: Key,
        count: usize,
    },
}

impl Elements {
    /// The elements of `all` in runs of at most `per_op`.
    pub fn runs_of(all: &Arc<ElementMap>, per_op: usize) -> Vec<Elements> {
        let mut runs = Vec::new();
        let mut keys = all.keys();
        while let Some(first) = keys.next() {
            let count = 1 + keys.by_ref().take(per_op.max(1) - 1).count();
            runs.push(Elements::Shared {
                all: all.clone(),
                first,
                count,
            });
        }
        runs
    }

    pub fn len(&self) -> usize {
        match self {
            Elements::Listed(v) => v.len(),
            Elements::Shared { count, .. } => *count,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> Box<dyn Iterator<Item = (Key, Option<Value>)> + '_> {
        match self {
            Elements::Listed(v) => Box::new(v.iter().cloned()),
            Elements::Shared { all, first, count } => Box::new(all.iter_from(*first).take(*count)),
        }
    }

    /// Keeps the first `at` elements and returns the others.
    pub fn split_off(&mut self, at: usize) -> Elements {
        match self {
            Elements::Listed(v) => Elements::Listed(v.split_off(at.min(v.len()))),
            Elements::Shared { all, first, count } => {
                let at = at.min(*count);
                let rest = all.keys_from(*first).nth(at);
                let tail = match rest {
                    Some(k) if at < *count => Elements::Shared {
                        all: all.clone(),
                        first: k,
                        count: *count - at,
                    },
                    _ => Elements::Listed(Vec::new()),
                };
                *count = at;
                tail
            }
        }
    }
}

impl From<Vec<(Key, Option<Value>)>> for Elements {
    fn from(v: Vec<(Key, Option<Value>)>) -> Elements {
        Elements::Listed(v)
    }
}

impl FromIterator<(Key, Option<Value>)> for Elements {
    fn from_iter<I: IntoIterator<Item = (Key, Option<Value>)>>(iter: I) -> Elements {
        Elements::Listed(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a Elements {
    type Item = (Key, Option<Value>);
    type IntoIter = Box<dyn Iterator<Item = (Key, Option<Value>)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Equal when they add the same elements, however they hold them.
impl PartialEq for Elements {
    fn eq(&self, other: &Elements) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Elements {}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transaction {
    pub family: Family,
    pub ops: Vec<Op>,
}

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// How many objects (tables, chains, rules, sets and elements) the transaction adds or
    /// deletes: while anyone listens, the kernel builds a notification for each of them.
    pub fn objects(&self) -> usize {
        self.ops.iter().map(Op::objects).sum()
    }
}

impl Op {
    /// The objects this op adds or deletes (a flushed chain counts as one, whatever it held).
    fn objects(&self) -> usize {
        match self {
            Op::AddRules { rules, .. } => rules.len(),
            Op::AddElements { elements, .. } => elements.len(),
            Op::DeleteElements { keys, .. } => keys.len(),
            _ => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::ruleset::Proto;

    fn map(n: u16) -> Arc<ElementMap> {
        Arc::new(
            (0..n)
                .map(|i| (Key::ProtoPort(Proto::Tcp, i), None))
                .collect(),
        )
    }

    fn listed(e: &Elements) -> Vec<(Key, Option<Value>)> {
        e.iter().collect()
    }

    #[test]
    fn shared_runs_cover_the_set_once_in_order() {
        for (n, per_op) in [(0, 200), (1, 200), (200, 200), (201, 200), (1000, 7)] {
            let all = map(n);
            let runs = Elements::runs_of(&all, per_op);
            assert!(runs.iter().all(|r| (1..=per_op).contains(&r.len())));
            let joined: Vec<_> = runs.iter().flat_map(listed).collect();
            let want: Vec<_> = all.iter().collect();
            assert_eq!(joined, want, "{n} elements, {per_op} per op");
        }
    }

    #[test]
    fn split_off_keeps_the_order_and_equality_ignores_the_form() {
        let all = map(10);
        for at in [0, 1, 5, 9, 10, 12] {
            let mut head = Elements::runs_of(&all, 10).remove(0);
            let mut listed_head: Elements = listed(&head).into();
            let tail = head.split_off(at);
            let listed_tail = listed_head.split_off(at);
            assert_eq!(head.len(), at.min(10));
            assert_eq!(head, listed_head);
            assert_eq!(tail, listed_tail);
            assert_eq!(head.len() + tail.len(), 10);
        }
        assert_ne!(
            Elements::runs_of(&all, 10)[0],
            Elements::runs_of(&map(9), 10)[0]
        );
    }

    #[test]
    fn objects_count_each_element_and_rule() {
        let all = map(700);
        let mut ops: Vec<Op> = Elements::runs_of(&all, 200)
            .into_iter()
            .map(|elements| Op::AddElements {
                set: "s".into(),
                elements,
            })
            .collect();
        ops.push(Op::DeleteElements {
            set: "s".into(),
            keys: all.keys().take(3).collect(),
        });
        ops.push(Op::DeleteSet { name: "t".into() });
        let tx = Transaction {
            family: Family::V4,
            ops,
        };
        assert_eq!(tx.ops.len(), 6);
        assert_eq!(tx.objects(), 700 + 3 + 1);
    }
}
