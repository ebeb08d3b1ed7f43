//! The flat path for Service ports with more endpoints than the endpoint lists hold (17 to
//! [`BIG_MAX_ENDPOINTS`], without session affinity): their endpoints are elements of one shared
//! map per kind of list, chosen by rejection sampling through fixed chains, so that adding such
//! a Service, changing its endpoints or crossing a power of two only adds and deletes map
//! elements, as for the short lists (docs/performance.md, "A flat path for large Services").
//!
//! A destination with N endpoints, 2^(J-1) < N ≤ 2^J, has the dense keys `DEST . 0` …
//! `DEST . N-1` in `big-endpoints` (`big-nodeport-endpoints` etc. for the other kinds of
//! list) and the element `DEST` in the class set `big-class-J`. The list chain
//! (`cluster-endpoints` …) sends members of `big-class-J` to chain `big-J`: [`DRAWS`] times
//! `jump big-draw-J`, whose one rule DNATs through `DEST . numgen random mod 2^J`; a draw of N
//! or more misses the map and the next jump draws again, so each endpoint gets exactly 1/N of
//! the connections. A draw hits with probability above 1/2, so all [`DRAWS`] miss less than once
//! in a million connections; those go to the destination's first endpoint (`big-first`, the same
//! map with `numgen random mod 1`). The chains, rules and sets are the same at every size.
//!
//! Only one rule per class uses the map (through the jumps): the kernel checks every added
//! element of a map against each rule that uses it, and 180 rules made an element cost three
//! times as much.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

use foldhash::fast::RandomState;
use std::sync::LazyLock;

use super::{EndpointLists, Fragment, LIST_MAX_ENDPOINTS};
use crate::net::addr_bits;
use crate::nft::ruleset::{ElementMap, Key, Target, Value};

/// The smallest and largest classes: 2^(J-1) < N ≤ 2^J.
pub const BIG_CLASS_MIN: u32 = 5;
pub const BIG_CLASS_MAX: u32 = 13;

/// Most endpoints a Service port may have on the flat path; beyond it the port keeps a chain of
/// its own.
pub const BIG_MAX_ENDPOINTS: usize = 1 << BIG_CLASS_MAX;

/// Draws before the fallback to the first endpoint: each hits with probability N/2^J > 1/2.
pub const DRAWS: usize = 20;

const CLASSES: usize = (BIG_CLASS_MAX - BIG_CLASS_MIN + 1) as usize;

/// The names of one kind of list's objects on the flat path.
struct Names {
    map: String,
    first: String,
    class_sets: Vec<String>,
    chains: Vec<String>,
    draws: Vec<String>,
}

static NAMES: LazyLock<Vec<Names>> = LazyLock::new(|| {
    EndpointLists::ALL
        .iter()
        .map(|lists| {
            let p = lists.big_prefix();
            let classes = BIG_CLASS_MIN..=BIG_CLASS_MAX;
            Names {
                map: format!("{p}-endpoints"),
                first: format!("{p}-first"),
                class_sets: classes.clone().map(|j| format!("{p}-class-{j}")).collect(),
                chains: classes.clone().map(|j| format!("{p}-{j}")).collect(),
                draws: classes.map(|j| format!("{p}-draw-{j}")).collect(),
            }
        })
        .collect()
});

impl EndpointLists {
    fn big_prefix(self) -> &'static str {
        match self {
            EndpointLists::ClusterServices => "big",
            EndpointLists::LocalServices => "big-local",
            EndpointLists::ClusterNodePorts => "big-nodeport",
            EndpointLists::LocalNodePorts => "big-local-nodeport",
        }
    }

    fn names(self) -> &'static Names {
        &NAMES[self as usize]
    }

    /// The shared map of these lists' large destinations: `DEST . i` to endpoint i.
    pub fn big_map(self) -> &'static str {
        &self.names().map
    }

    /// The chain that DNATs to a destination's first endpoint when every draw missed.
    pub fn big_first(self) -> &'static str {
        &self.names().first
    }

    /// The set of destinations of class `j` ([`BIG_CLASS_MIN`] ≤ j ≤ [`BIG_CLASS_MAX`]).
    pub fn big_class_set(self, j: u32) -> &'static str {
        &self.names().class_sets[(j - BIG_CLASS_MIN) as usize]
    }

    /// The chain of class `j`: [`DRAWS`] jumps to [`EndpointLists::big_draw`], then the fallback.
    pub fn big_chain(self, j: u32) -> &'static str {
        &self.names().chains[(j - BIG_CLASS_MIN) as usize]
    }

    /// The chain whose one rule draws `numgen random mod 2^j` in [`EndpointLists::big_map`].
    pub fn big_draw(self, j: u32) -> &'static str {
        &self.names().draws[(j - BIG_CLASS_MIN) as usize]
    }

    /// Which kind of list `map` is the flat-path map of, if it is one.
    pub fn of_big_map(map: &str) -> Option<EndpointLists> {
        EndpointLists::ALL.into_iter().find(|l| l.big_map() == map)
    }
}

/// The classes, smallest first.
pub fn classes() -> impl Iterator<Item = u32> {
    BIG_CLASS_MIN..=BIG_CLASS_MAX
}

/// The class J of a list of `n` endpoints (2^(J-1) < n ≤ 2^J), for
/// `LIST_MAX_ENDPOINTS < n ≤ BIG_MAX_ENDPOINTS`.
pub fn class_of(n: usize) -> u32 {
    debug_assert!(n > LIST_MAX_ENDPOINTS && n <= BIG_MAX_ENDPOINTS);
    n.next_power_of_two().trailing_zeros().max(BIG_CLASS_MIN)
}

const _: () = assert!(CLASSES == 9 && 1 << (BIG_CLASS_MIN - 1) == LIST_MAX_ENDPOINTS);

/// One destination's flat-path list: entry i of `map` maps `dest . i` to `endpoints[i]`.
/// The endpoints are plain (address, port) pairs, shared by the lists of a port's frontends
/// (which are alike) and compared as blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BigList {
    pub map: &'static str,
    /// `ADDR . PROTO . PORT`, or `PROTO . PORT` for a node port.
    pub dest: Key,
    pub endpoints: Arc<[Target]>,
}

impl BigList {
    /// The list's elements: (map, `dest . i`, endpoint i).
    pub fn elements(&self) -> impl Iterator<Item = (&'static str, Key, Option<Value>)> + '_ {
        self.entries()
            .map(|(key, target)| (self.map, key, Some(self.value(target))))
    }

    /// What an entry maps to ([`Key::list_value`] of the destination).
    pub fn value(&self, target: Target) -> Value {
        self.dest.list_value(target)
    }

    /// The list's entries: `dest . i` and endpoint i.
    pub fn entries(&self) -> impl Iterator<Item = (Key, Target)> + '_ {
        (0u16..)
            .zip(self.endpoints.iter())
            .map(|(i, ep)| (self.entry(i), *ep))
    }

    /// The key of entry `i`.
    pub fn entry(&self, i: u16) -> Key {
        self.dest.list_entry(i).expect("a destination key")
    }
}

/// Adds the flat-path elements of destination `dest` (`ADDR . PROTO . PORT`, or `PROTO . PORT`
/// for a node port) with `endpoints` (more than [`LIST_MAX_ENDPOINTS`], at most
/// [`BIG_MAX_ENDPOINTS`]): its class-set element and entry i → endpoint i.
pub(super) fn add_elements(
    part: &mut Fragment,
    lists: EndpointLists,
    dest: Key,
    endpoints: Arc<[Target]>,
) {
    part.elements
        .insert((lists.big_class_set(class_of(endpoints.len())), dest), None);
    let map = lists.big_map();
    // A Service may name one address twice (an external IP that is also its load-balancer
    // IP): one list, as one element per key.
    if part.lists.iter().any(|l| l.map == map && l.dest == dest) {
        return;
    }
    part.lists.push(BigList {
        map,
        dest,
        endpoints,
    });
}

impl Fragment {
    /// Reorders this fragment's flat-path lists so that every endpoint that `before` (the
    /// elements a map held) has at an index below the new length keeps it, and the others fill
    /// the free indices. An endpoint change then touches O(1) elements: a removed endpoint's
    /// index gets the last endpoint, an added one the next index. The builder lists endpoints
    /// in their sorted order, which would shift every index after a removed endpoint.
    pub fn keep_big_order<'a>(&mut self, before: impl Fn(&str) -> Option<&'a ElementMap>) {
        for list in &mut self.lists {
            let Some(elements) = before(list.map) else {
                continue;
            };
            let old = elements.list_targets(list.dest, list.endpoints.len());
            if let Some(order) = kept_order(&old, &list.endpoints, address_key) {
                list.endpoints = reorder(&list.endpoints, &order).into();
            }
        }
    }
}

/// A list entry's endpoint address, as [`kept_order`] matches entries (a list is of one family).
pub(super) fn address_key(&(addr, _): &Target) -> u128 {
    addr_bits(addr)
}

/// The order that keeps each value `old` has at index i (below `new`'s length) at i, the values
/// `old` does not place filling the remaining indices in their order: entry i is the index in
/// `new` of the value that goes to index i; None for `new`'s own order (nothing moved, or
/// nothing to keep). Values are matched by `key`: two values with one key may cost the change
/// an element more, never a wrong list, since the order is always a permutation.
pub(super) fn kept_order<T: PartialEq, K: Eq + Hash>(
    old: &[Option<T>],
    new: &[T],
    key: impl Fn(&T) -> K,
) -> Option<Vec<usize>> {
    if old.len() >= new.len() && new.iter().zip(old).all(|(n, o)| o.as_ref() == Some(n)) {
        return None; // Nothing moved (another list of the Service changed).
    }
    if old.iter().all(Option::is_none) {
        return None; // Nothing to keep (a new list).
    }
    const NONE: usize = usize::MAX;
    // The lowest index of each key in `new`; equal keys chained through `next_equal`.
    let mut first: HashMap<K, usize, RandomState> =
        HashMap::with_capacity_and_hasher(new.len(), RandomState::default());
    let mut next_equal = vec![NONE; new.len()];
    for (i, v) in new.iter().enumerate().rev() {
        if let Some(j) = first.insert(key(v), i) {
            next_equal[i] = j;
        }
    }
    let mut taken = vec![false; new.len()];
    let mut slots: Vec<usize> = vec![NONE; new.len()];
    for (slot, was) in slots.iter_mut().zip(old) {
        if let Some(v) = was
            && let Some(i) = first.get_mut(&key(v))
            && *i != NONE
        {
            *slot = *i;
            taken[*i] = true;
            *i = next_equal[*i];
        }
    }
    let mut rest = (0..new.len()).filter(|i| !taken[*i]);
    for slot in &mut slots {
        if *slot == NONE {
            *slot = rest.next().expect("as many values as slots");
        }
    }
    Some(slots)
}

/// `values` in `order` (a permutation of their indices).
pub(super) fn reorder<T: Copy>(values: &[T], order: &[usize]) -> Vec<T> {
    order.iter().map(|&i| values[i]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_17_to_8192() {
        assert_eq!(class_of(17), 5);
        assert_eq!(class_of(32), 5);
        assert_eq!(class_of(33), 6);
        assert_eq!(class_of(1000), 10);
        assert_eq!(class_of(4096), 12);
        assert_eq!(class_of(4097), 13);
        assert_eq!(class_of(BIG_MAX_ENDPOINTS), BIG_CLASS_MAX);
        for n in LIST_MAX_ENDPOINTS + 1..=BIG_MAX_ENDPOINTS {
            let j = class_of(n);
            assert!(1usize << (j - 1) < n && n <= 1 << j, "{n}: {j}");
        }
    }

    #[test]
    fn names_are_distinct() {
        let mut all = std::collections::BTreeSet::new();
        for lists in EndpointLists::ALL {
            assert!(all.insert(lists.big_map()));
            assert!(all.insert(lists.big_first()));
            for j in classes() {
                assert!(all.insert(lists.big_class_set(j)));
                assert!(all.insert(lists.big_chain(j)));
                assert!(all.insert(lists.big_draw(j)));
            }
            assert_eq!(EndpointLists::of_big_map(lists.big_map()), Some(lists));
        }
        assert_eq!(EndpointLists::ClusterServices.big_map(), "big-endpoints");
        assert_eq!(EndpointLists::ClusterServices.big_chain(5), "big-5");
        assert_eq!(EndpointLists::ClusterServices.big_draw(13), "big-draw-13");
        assert_eq!(EndpointLists::of_big_map("cluster-endpoints-3"), None);
    }

    fn order(old: &[u32], new: &[u32]) -> Vec<u32> {
        let old: Vec<Option<u32>> = old.iter().map(|v| Some(*v)).collect();
        match kept_order(&old, new, |v| *v) {
            Some(order) => reorder(new, &order),
            None => new.to_vec(),
        }
    }

    #[test]
    fn an_endpoint_change_moves_at_most_one_other() {
        let old: Vec<u32> = (0..20).collect();
        // Endpoint 3 removed: the last one takes its index.
        let mut want = old.clone();
        want[3] = 19;
        want.pop();
        let new: Vec<u32> = (0..20).filter(|v| *v != 3).collect();
        assert_eq!(order(&old, &new), want);
        // An endpoint added (sorted into the middle of `new`): it gets the next index.
        let new: Vec<u32> = [0, 1, 2, 100].into_iter().chain(3..20).collect();
        let mut want = old.clone();
        want.push(100);
        assert_eq!(order(&old, &new), want);
        // Replaced in place: one index changes.
        let new: Vec<u32> = (0..20).map(|v| if v == 7 { 70 } else { v }).collect();
        let got = order(&old, &new);
        assert_eq!(got.iter().zip(&old).filter(|(a, b)| a != b).count(), 1);
        // Nothing before: the builder's order; duplicates kept as many times as wanted.
        assert_eq!(kept_order(&[None, None], &[5, 4], |v| *v), None);
        assert_eq!(order(&[4, 4, 5], &[5, 4, 6]), vec![4, 6, 5]);
        assert_eq!(order(&[4, 4, 5], &[4, 4, 4]), vec![4, 4, 4]);
    }
}
