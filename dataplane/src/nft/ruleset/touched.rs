//! The keys of one set a change touched, with what each was before the change.
//!
//! A change records its keys run by run (a large Service's list is thousands of keys of one
//! map, already in order) and is then only walked in key order: by the planner, by the undo of
//! a change and by the affinity check. A sorted vector takes a run as it comes, where a B-tree
//! would build a node for every eleven keys.

use std::cmp::Ordering;

use crate::nft::ruleset::{Key, Was};

/// Keys in ascending order, each once, with what each was before the change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Touched(Vec<(Key, Was)>);

/// How a [`Touched`] is walked: `(key, was)` pairs in key order.
pub type Iter<'a> =
    std::iter::Map<std::slice::Iter<'a, (Key, Was)>, fn(&(Key, Was)) -> (&Key, &Was)>;

fn split(entry: &(Key, Was)) -> (&Key, &Was) {
    (&entry.0, &entry.1)
}

impl Touched {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> Iter<'_> {
        self.0.iter().map(split as fn(&(Key, Was)) -> (&Key, &Was))
    }

    /// The entries, in key order.
    pub fn entries(&self) -> &[(Key, Was)] {
        &self.0
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &Key> + Clone + '_ {
        self.0.iter().map(|(k, _)| k)
    }

    pub fn get(&self, key: &Key) -> Option<&Was> {
        let i = self.0.binary_search_by(|(k, _)| k.cmp(key)).ok()?;
        Some(&self.0[i].1)
    }

    /// Adds `entries` whose keys are not recorded yet: a key keeps what it was when first
    /// recorded, which is what it was before the whole change (within `entries` too, the first
    /// of a key stands). A run in key order, as a large Service's list comes, is taken as it
    /// is; any other order is sorted first.
    pub fn record(&mut self, mut entries: Vec<(Key, Was)>) {
        if !entries.is_sorted_by(|a, b| a.0 < b.0) {
            // Stable: of equal keys, the first comes first and is the one `dedup` keeps.
            entries.sort_by_key(|e| e.0);
            entries.dedup_by(|later, kept| later.0 == kept.0);
        }
        let Some((first, _)) = entries.first() else {
            return;
        };
        // The usual case, a run past everything recorded so far, is appended as it is.
        match self.0.last() {
            None => {
                self.0 = entries;
                return;
            }
            Some((last, _)) if last < first => {
                self.0.extend(entries);
                return;
            }
            Some(_) => {}
        }
        let earlier = std::mem::take(&mut self.0);
        let mut merged = Vec::with_capacity(earlier.len() + entries.len());
        let mut earlier = earlier.into_iter().peekable();
        let mut later = entries.into_iter().peekable();
        loop {
            let order = match (earlier.peek(), later.peek()) {
                (Some((a, _)), Some((b, _))) => a.cmp(b),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (None, None) => break,
            };
            match order {
                Ordering::Less => merged.extend(earlier.next()),
                Ordering::Greater => merged.extend(later.next()),
                Ordering::Equal => {
                    merged.extend(earlier.next());
                    later.next();
                }
            }
        }
        self.0 = merged;
    }

    /// Records the entries `fill` pushes, as [`Touched::record`] would take them. A run in key
    /// order past everything recorded so far (a large Service's list, as it usually comes) is
    /// written in place rather than collected and copied.
    pub fn record_with(&mut self, fill: impl FnOnce(&mut Vec<(Key, Was)>)) {
        let start = self.0.len();
        fill(&mut self.0);
        let (before, run) = self.0.split_at(start);
        let past = match (before.last(), run.first()) {
            (Some((last, _)), Some((first, _))) => last < first,
            _ => true,
        };
        if !(past && run.is_sorted_by(|a, b| a.0 < b.0)) {
            let run = self.0.split_off(start);
            self.record(run);
        }
    }
}

impl<'a> IntoIterator for &'a Touched {
    type Item = (&'a Key, &'a Was);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// Any entries, in any order, as [`Touched::record`] takes them.
impl FromIterator<(Key, Was)> for Touched {
    fn from_iter<I: IntoIterator<Item = (Key, Was)>>(iter: I) -> Touched {
        let mut touched = Touched::default();
        touched.record(iter.into_iter().collect());
        touched
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::{IpAddr, Ipv4Addr};

    use proptest::prelude::*;

    use super::*;
    use crate::nft::ruleset::{Proto, Value};

    fn key(n: u8) -> Key {
        Key::AddrProtoPort(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), Proto::Tcp, 80)
    }

    fn was(n: u8) -> Was {
        match n % 3 {
            0 => None,
            1 => Some(None),
            _ => Some(Some(Value::Endpoint(
                IpAddr::V4(Ipv4Addr::new(10, 1, 0, n)),
                80,
            ))),
        }
    }

    proptest! {
        /// Recording runs behaves as a `BTreeMap` into which each run's keys are put unless
        /// already there.
        #[test]
        fn records_as_a_btree_map_keeping_the_first(
            runs in prop::collection::vec(
                prop::collection::btree_map(any::<u8>(), any::<u8>(), 0..20),
                0..6,
            ),
        ) {
            let mut touched = Touched::default();
            let mut model: BTreeMap<Key, Was> = BTreeMap::new();
            for run in &runs {
                let entries: Vec<(Key, Was)> = run.iter().map(|(k, w)| (key(*k), was(*w))).collect();
                for (k, w) in &entries {
                    model.entry(*k).or_insert_with(|| w.clone());
                }
                touched.record(entries);
            }
            let got: Vec<(Key, Was)> = touched.iter().map(|(k, w)| (*k, w.clone())).collect();
            let want: Vec<(Key, Was)> = model.iter().map(|(k, w)| (*k, w.clone())).collect();
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(touched.len(), model.len());
            for k in 0..=255u8 {
                prop_assert_eq!(touched.get(&key(k)), model.get(&key(k)));
            }
            let mut filled = Touched::default();
            for run in &runs {
                filled.record_with(|v| v.extend(run.iter().map(|(k, w)| (key(*k), was(*w)))));
            }
            prop_assert_eq!(&filled, &touched);
            let collected: Touched = runs
                .iter()
                .flat_map(|run| run.iter().map(|(k, w)| (key(*k), was(*w))))
                .collect();
            prop_assert_eq!(collected, touched);
        }
    }
}
