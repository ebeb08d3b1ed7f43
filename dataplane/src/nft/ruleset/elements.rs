//! A set's elements, in key order, kept compactly.
//!
//! Most of a large cluster's elements are endpoint-list entries (`DEST . i → ENDPOINT`, see
//! [`Key::list_entry`]): at 100k Services about 85% of both families' 2.3M elements. As B-tree
//! entries each cost 48 bytes of key and value plus the tree around them; here each list is one
//! vector indexed by `i`, an IPv4 entry 8 bytes, and a list of up to two IPv4 entries needs no
//! heap block of its own. The next most common elements, plain-set IPv4 addresses (ClusterIPs,
//! hairpin endpoints), are 8-byte numbers in a set of their own. Every other element (and a
//! list entry this layout cannot hold: a value other than an endpoint, or an index far past its
//! list's end) stays in a B-tree. The map behaves as the `BTreeMap<Key, Option<Value>>` it
//! replaces, but hands out its elements by value.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::iter::Peekable;
use std::net::{IpAddr, Ipv4Addr};

use smallvec::SmallVec;

use crate::nft::ruleset::{Key, Value};

/// How far past the end of its list an entry may land and still be kept in the list (a list
/// has holes only while a change moves its entries; a wild index must not allocate a huge
/// vector).
const MAX_GAP: usize = 16;

/// An endpoint an entry leads to.
pub type Target = (IpAddr, u16);

/// IPv4 entries of a list. Most Services have one to three endpoints: up to two are held in
/// place, without a heap block (the list is 32 bytes either way).
type V4Entries = SmallVec<[Option<(Ipv4Addr, u16)>; 2]>;

/// One destination's entries by index; `None` is a hole. Never ends in a hole.
#[derive(Clone, Debug)]
enum List {
    V4(V4Entries),
    /// IPv6 endpoints, or a mix of families.
    Any(Vec<Option<Target>>),
}

impl List {
    fn with_capacity(first: Target, n: usize) -> List {
        match first.0 {
            IpAddr::V4(_) => List::V4(V4Entries::with_capacity(n)),
            IpAddr::V6(_) => List::Any(Vec::with_capacity(n)),
        }
    }

    fn len(&self) -> usize {
        match self {
            List::V4(v) => v.len(),
            List::Any(v) => v.len(),
        }
    }

    fn get(&self, i: usize) -> Option<Target> {
        match self {
            List::V4(v) => v.get(i).copied().flatten().map(|(a, p)| (IpAddr::V4(a), p)),
            List::Any(v) => v.get(i).copied().flatten(),
        }
    }

    /// Puts `target` at `i` (at most [`MAX_GAP`] past the end), returning what was there.
    fn set(&mut self, i: usize, target: Target) -> Option<Target> {
        if let (List::V4(v), IpAddr::V6(_)) = (&*self, target.0) {
            let widened = v.iter().map(|e| e.map(|(a, p)| (IpAddr::V4(a), p)));
            *self = List::Any(widened.collect());
        }
        let old = self.get(i);
        match self {
            List::V4(v) => {
                let IpAddr::V4(addr) = target.0 else {
                    unreachable!("widened above")
                };
                if v.len() <= i {
                    v.resize(i + 1, None);
                }
                v[i] = Some((addr, target.1));
            }
            List::Any(v) => {
                if v.len() <= i {
                    v.resize(i + 1, None);
                }
                v[i] = Some(target);
            }
        }
        old
    }

    /// Takes the entry at `i` out, trimming the holes that end the list.
    fn take(&mut self, i: usize) -> Option<Target> {
        let old = self.get(i)?;
        fn clear<T>(v: &mut [Option<T>], i: usize) -> usize {
            v[i] = None;
            v.iter()
                .rposition(Option::is_some)
                .map_or(0, |last| last + 1)
        }
        match self {
            List::V4(v) => {
                let len = clear(v, i);
                v.truncate(len);
            }
            List::Any(v) => {
                let len = clear(v, i);
                v.truncate(len);
            }
        }
        Some(old)
    }
}

/// A set's elements: key to value (maps) or `None` (sets), in key order.
#[derive(Clone, Default)]
pub struct ElementMap {
    /// Every element the lists and `addrs` do not hold.
    other: BTreeMap<Key, Option<Value>>,
    /// Plain-set elements `ADDR` and `ADDR . ADDR` of IPv4 addresses (a cluster's ClusterIPs,
    /// its hairpin endpoints), as [`addr_code`]s: 8 bytes instead of 48.
    addrs: BTreeSet<u64>,
    /// Endpoint-list entries with an endpoint as value (or, in a shared address list, an
    /// address: see [`as_entry`]), by destination ([`Key::list_destination`]). A key is here or
    /// in `other`, never in both.
    lists: BTreeMap<Key, List>,
    len: usize,
}

/// The list entry `key → value` as destination, index and endpoint, if it is one. An entry of a
/// shared address list ([`Key::AddrProtoIndex`] → [`Value::Addr`]) is held as its address with
/// port 0 ([`Key::list_value`] reverses it).
fn as_entry(key: &Key, value: &Option<Value>) -> Option<(Key, usize, Target)> {
    let (dest, i) = key.list_destination()?;
    match (key, value) {
        (Key::AddrProtoIndex(..), Some(Value::Addr(addr))) => {
            Some((dest, usize::from(i), (*addr, 0)))
        }
        (Key::AddrProtoIndex(..), _) => None,
        (_, Some(Value::Endpoint(addr, port))) => Some((dest, usize::from(i), (*addr, *port))),
        _ => None,
    }
}

/// `Key::Addr(a)` and `Key::AddrPair(a)` of an IPv4 address as one number, in key order (every
/// `Addr` sorts below every `AddrPair`, as the variants do).
fn addr_code(key: &Key) -> Option<u64> {
    match key {
        Key::Addr(IpAddr::V4(a)) => Some(u64::from(u32::from(*a))),
        Key::AddrPair(IpAddr::V4(a)) => Some(1 << 32 | u64::from(u32::from(*a))),
        _ => None,
    }
}

fn code_key(code: u64) -> Key {
    let addr = IpAddr::V4(Ipv4Addr::from(code as u32));
    if code >> 32 == 0 {
        Key::Addr(addr)
    } else {
        Key::AddrPair(addr)
    }
}

/// The first code whose key is `first` or above.
fn addr_code_from(first: &Key) -> u64 {
    if let Some(code) = addr_code(first) {
        return code;
    }
    // Any other key sorts below or above all IPv4 `Addr` keys alike (all IPv4 addresses sort
    // below all IPv6 ones), and so for `AddrPair`.
    let max = IpAddr::V4(Ipv4Addr::BROADCAST);
    if *first <= Key::Addr(max) {
        0
    } else if *first <= Key::AddrPair(max) {
        1 << 32
    } else {
        2 << 32
    }
}

fn entry_key(dest: &Key, i: usize) -> Key {
    let i = u16::try_from(i).expect("list indices come from u16 keys");
    dest.list_entry(i).expect("lists are keyed by destinations")
}

impl ElementMap {
    pub fn new() -> ElementMap {
        ElementMap::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        *self = ElementMap::new();
    }

    /// Keeps the elements for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&Key, &Option<Value>) -> bool) {
        let kept = self.iter().filter(|(k, v)| keep(k, v)).collect();
        *self = ElementMap::from_sorted(kept);
    }

    fn listed(&self, key: &Key) -> Option<Target> {
        let (dest, i) = key.list_destination()?;
        self.lists.get(&dest)?.get(usize::from(i))
    }

    fn has_addr(&self, key: &Key) -> bool {
        addr_code(key).is_some_and(|code| self.addrs.contains(&code))
    }

    pub fn get(&self, key: &Key) -> Option<Option<Value>> {
        if let Some(target) = self.listed(key) {
            return Some(Some(key.list_value(target)));
        }
        if self.has_addr(key) {
            return Some(None);
        }
        self.other.get(key).cloned()
    }

    /// [`ElementMap::get`] of each of `keys`, in order. A run of one destination's list entries
    /// (a large Service's keys, sorted) finds its list once instead of once per key.
    pub fn get_each<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k Key>,
    ) -> impl Iterator<Item = Option<Option<Value>>> {
        let mut last: Option<(Key, Option<&List>)> = None;
        keys.into_iter().map(move |key| {
            let Some((dest, i)) = key.list_destination() else {
                return self.get(key);
            };
            let list = match last {
                Some((d, list)) if d == dest => list,
                _ => {
                    let list = self.lists.get(&dest);
                    last = Some((dest, list));
                    list
                }
            };
            match list.and_then(|l| l.get(usize::from(i))) {
                Some(target) => Some(Some(key.list_value(target))),
                None => self.other.get(key).cloned(),
            }
        })
    }

    /// The endpoints of `dest`'s list entries `dest . 0` … `dest . n-1`, by index (`None` where
    /// there is no entry): [`ElementMap::get`] of each, read straight from the list, which is a
    /// large Service's whole endpoint list at the cost of a copy.
    pub fn list_targets(&self, dest: Key, n: usize) -> Vec<Option<Target>> {
        let mut out = vec![None; n];
        let (Some(first), Some(last)) = (dest.list_entry(0), dest.list_entry(u16::MAX)) else {
            return out;
        };
        if let Some(list) = self.lists.get(&dest) {
            for (i, target) in out.iter_mut().enumerate().take(list.len()) {
                *target = list.get(i);
            }
        }
        // Entries the list cannot hold (see `insert`); a key is never in both. One whose value
        // is not an endpoint reads as a hole: no endpoint is kept there.
        for (key, value) in self.other.range(first..=last) {
            match key.list_destination() {
                Some((_, i)) if usize::from(i) < n => {
                    out[usize::from(i)] = as_entry(key, value).map(|(_, _, target)| target);
                }
                _ => break,
            }
        }
        out
    }

    pub fn contains_key(&self, key: &Key) -> bool {
        self.listed(key).is_some() || self.has_addr(key) || self.other.contains_key(key)
    }

    /// Adds or replaces `key`, returning what it was.
    pub fn insert(&mut self, key: Key, value: Option<Value>) -> Option<Option<Value>> {
        if let Some((dest, i, target)) = as_entry(&key, &value)
            && !self.other.contains_key(&key)
        {
            match self.lists.get_mut(&dest) {
                Some(list) if i < list.len() + MAX_GAP => {
                    let old = list.set(i, target);
                    if old.is_none() {
                        self.len += 1;
                    }
                    return old.map(|target| Some(key.list_value(target)));
                }
                None if i < MAX_GAP => {
                    let mut list = List::with_capacity(target, i + 1);
                    list.set(i, target);
                    self.lists.insert(dest, list);
                    self.len += 1;
                    return None;
                }
                _ => {}
            }
        }
        let old = self.remove(&key);
        match addr_code(&key).filter(|_| value.is_none()) {
            Some(code) => {
                self.addrs.insert(code);
            }
            None => {
                self.other.insert(key, value);
            }
        }
        self.len += 1;
        old
    }

    /// [`ElementMap::insert`] of each of `elements`, in order, calling `was` with each key,
    /// whether its new value is `Some` and what it was. A run of one destination's list entries
    /// (a large Service's list) finds its list once, not once per entry.
    pub fn insert_each(
        &mut self,
        elements: impl IntoIterator<Item = (Key, Option<Value>)>,
        mut was: impl FnMut(Key, bool, Option<Option<Value>>),
    ) {
        let mut elements = elements.into_iter().peekable();
        while let Some((key, value)) = elements.next() {
            let listed = as_entry(&key, &value).filter(|_| !self.other.contains_key(&key));
            let Some((dest, i, target)) = listed else {
                let has_value = value.is_some();
                was(key, has_value, self.insert(key, value));
                continue;
            };
            let Some(list) = self.lists.get_mut(&dest).filter(|l| i < l.len() + MAX_GAP) else {
                was(key, true, self.insert(key, value));
                continue;
            };
            // This entry, then the rest of the run, where `insert` would put them in this list.
            let mut entry = Some((key, i, target));
            while let Some((key, i, target)) = entry.take() {
                let old = list.set(i, target);
                self.len += usize::from(old.is_none());
                was(key, true, old.map(|target| Some(key.list_value(target))));
                if let Some((key, value)) = elements.peek()
                    && let Some((d, i, target)) = as_entry(key, value)
                    && d == dest
                    && i < list.len() + MAX_GAP
                    && !self.other.contains_key(key)
                {
                    entry = Some((*key, i, target));
                    elements.next();
                }
            }
        }
    }

    /// [`ElementMap::remove`] of each of `keys`, in order, calling `was` with each key and what
    /// it was. A run of one destination's list entries finds its list once.
    pub fn remove_each(
        &mut self,
        keys: impl IntoIterator<Item = Key>,
        mut was: impl FnMut(Key, Option<Option<Value>>),
    ) {
        let mut keys = keys.into_iter().peekable();
        while let Some(key) = keys.next() {
            let Some((dest, _)) = key.list_destination() else {
                was(key, self.remove(&key));
                continue;
            };
            let Some(list) = self.lists.get_mut(&dest) else {
                was(key, self.remove(&key));
                continue;
            };
            let same_list = |k: &Key| k.list_destination().is_some_and(|(d, _)| d == dest);
            let run = std::iter::once(key).chain(std::iter::from_fn(|| keys.next_if(same_list)));
            for key in run {
                let taken = key
                    .list_destination()
                    .and_then(|(_, i)| list.take(usize::from(i)));
                // Not in the list: in `other`, if anywhere (`insert` keeps it out of both).
                let old = match taken {
                    Some(target) => Some(Some(key.list_value(target))),
                    None => self.other.remove(&key),
                };
                self.len -= usize::from(old.is_some());
                was(key, old);
            }
            if list.len() == 0 {
                self.lists.remove(&dest);
            }
        }
    }

    /// Takes `key` out of its list, if a list holds it.
    fn take_listed(&mut self, key: &Key) -> Option<Target> {
        let (dest, i) = key.list_destination()?;
        let list = self.lists.get_mut(&dest)?;
        let old = list.take(usize::from(i))?;
        if list.len() == 0 {
            self.lists.remove(&dest);
        }
        self.len -= 1;
        Some(old)
    }

    pub fn remove(&mut self, key: &Key) -> Option<Option<Value>> {
        if let Some(target) = self.take_listed(key) {
            return Some(Some(key.list_value(target)));
        }
        if let Some(code) = addr_code(key)
            && self.addrs.remove(&code)
        {
            self.len -= 1;
            return Some(None);
        }
        let old = self.other.remove(key)?;
        self.len -= 1;
        Some(old)
    }

    /// The elements in key order.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            other: self.other.range::<Key, _>(..).peekable(),
            addrs: self.addrs.range(..).peekable(),
            lists: self.lists.range::<Key, _>(..),
            list: None,
            listed: None,
        }
    }

    /// The elements whose keys are `first` or above, in key order.
    pub fn iter_from(&self, first: Key) -> Iter<'_> {
        let mut iter = Iter {
            other: self.other.range(first..).peekable(),
            addrs: self.addrs.range(addr_code_from(&first)..).peekable(),
            lists: self.lists.range::<Key, _>(..),
            list: None,
            listed: None,
        };
        match first.list_destination() {
            // Lists hold keys in their destinations' order (`list_entry` keeps it).
            Some((dest, i)) => {
                iter.lists = self.lists.range(dest..);
                if let Some((d, list)) = self.lists.get_key_value(&dest) {
                    iter.lists.next();
                    iter.list = Some((d, list, usize::from(i)));
                }
            }
            // A key of another kind sorts below or above all of a list's entries alike.
            None => {
                let below = |(d, _): &(&Key, &List)| entry_key(d, 0) < first;
                let skipped = self.lists.iter().take_while(below).count();
                let mut lists = self.lists.range::<Key, _>(..);
                if skipped > 0 {
                    lists.nth(skipped - 1);
                }
                iter.lists = lists;
            }
        }
        iter
    }

    /// The elements whose keys are `first` to `last`, in key order.
    pub fn between(&self, first: Key, last: Key) -> impl Iterator<Item = (Key, Option<Value>)> {
        self.iter_from(first).take_while(move |(k, _)| *k <= last)
    }

    pub fn keys(&self) -> Keys<'_> {
        Keys(self.iter())
    }

    /// The keys that are `first` or above, in key order.
    pub fn keys_from(&self, first: Key) -> Keys<'_> {
        Keys(self.iter_from(first))
    }

    /// Builds the map from elements sorted by key, without two of one key.
    pub fn from_sorted(mut elements: Vec<(Key, Option<Value>)>) -> ElementMap {
        debug_assert!(elements.windows(2).all(|w| w[0].0 < w[1].0));
        let len = elements.len();
        let mut lists: Vec<(Key, List)> = Vec::new();
        let mut addrs = Vec::new();
        let mut other = Vec::new();
        for at in 0..elements.len() {
            let (key, value) = &mut elements[at];
            let Some((dest, i, target)) = as_entry(key, value) else {
                match addr_code(key).filter(|_| value.is_none()) {
                    Some(code) => addrs.push(code),
                    None => other.push((*key, value.take())),
                }
                continue;
            };
            match lists.last_mut() {
                Some((d, list)) if *d == dest && i < list.len() + MAX_GAP => {
                    list.set(i, target);
                }
                _ if i < MAX_GAP => {
                    // Sized for the entries of this destination that follow.
                    let mut n = i + 1;
                    for (k, v) in &elements[at + 1..] {
                        match as_entry(k, v) {
                            Some((d, j, _)) if d == dest && j < n + MAX_GAP => n = j + 1,
                            _ => break,
                        }
                    }
                    let mut list = List::with_capacity(target, n);
                    list.set(i, target);
                    lists.push((dest, list));
                }
                _ => other.push((*key, value.take())),
            }
        }
        ElementMap {
            // Both built in bulk from sorted keys: densely packed nodes.
            other: other.into_iter().collect(),
            addrs: addrs.into_iter().collect(),
            lists: lists.into_iter().collect(),
            len,
        }
    }
}

impl PartialEq for ElementMap {
    fn eq(&self, other: &ElementMap) -> bool {
        // One content may be laid out two ways (an entry in a list or apart).
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for ElementMap {}

impl fmt::Debug for ElementMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl FromIterator<(Key, Option<Value>)> for ElementMap {
    fn from_iter<I: IntoIterator<Item = (Key, Option<Value>)>>(iter: I) -> ElementMap {
        let mut elements: Vec<_> = iter.into_iter().collect();
        // Stable: of two elements with one key the later stays, as in a `BTreeMap`.
        elements.sort_by_key(|e| e.0);
        elements.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 = later.1.take();
            }
            same
        });
        ElementMap::from_sorted(elements)
    }
}

impl Extend<(Key, Option<Value>)> for ElementMap {
    fn extend<I: IntoIterator<Item = (Key, Option<Value>)>>(&mut self, iter: I) {
        for (key, value) in iter {
            self.insert(key, value);
        }
    }
}

impl<const N: usize> From<[(Key, Option<Value>); N]> for ElementMap {
    fn from(elements: [(Key, Option<Value>); N]) -> ElementMap {
        elements.into_iter().collect()
    }
}

impl<'a> IntoIterator for &'a ElementMap {
    type Item = (Key, Option<Value>);
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// The elements of an [`ElementMap`] in key order: the B-tree's and the lists' merged.
pub struct Iter<'a> {
    other: Peekable<std::collections::btree_map::Range<'a, Key, Option<Value>>>,
    addrs: Peekable<std::collections::btree_set::Range<'a, u64>>,
    lists: std::collections::btree_map::Range<'a, Key, List>,
    /// The list being walked and the next index in it.
    list: Option<(&'a Key, &'a List, usize)>,
    /// The next list entry, once found.
    listed: Option<(Key, Target)>,
}

impl Iter<'_> {
    fn next_listed(&mut self) -> Option<(Key, Target)> {
        loop {
            if let Some((dest, list, i)) = &mut self.list {
                while *i < list.len() {
                    let at = *i;
                    *i += 1;
                    if let Some(target) = list.get(at) {
                        return Some((entry_key(dest, at), target));
                    }
                }
            }
            let (dest, list) = self.lists.next()?;
            self.list = Some((dest, list, 0));
        }
    }
}

/// The next element as the map holds it.
enum Raw<'a> {
    Other(&'a Key, &'a Option<Value>),
    Addr(Key),
    Listed(Key, Target),
}

impl<'a> Iter<'a> {
    fn next_raw(&mut self) -> Option<Raw<'a>> {
        if self.listed.is_none() {
            self.listed = self.next_listed();
        }
        // The smallest of the three stores' next keys (a key is in one store only; most maps
        // use one store).
        let other = self.other.peek().map(|(key, _)| **key);
        let addr = self.addrs.peek().map(|code| code_key(**code));
        if let Some((key, _)) = &self.listed
            && other.is_none_or(|o| *key < o)
            && addr.is_none_or(|a| *key < a)
        {
            let (key, target) = self.listed.take().expect("matched");
            return Some(Raw::Listed(key, target));
        }
        if let Some(a) = addr
            && other.is_none_or(|o| a < o)
        {
            self.addrs.next();
            return Some(Raw::Addr(a));
        }
        self.other.next().map(|(k, v)| Raw::Other(k, v))
    }
}

impl Iterator for Iter<'_> {
    type Item = (Key, Option<Value>);

    fn next(&mut self) -> Option<(Key, Option<Value>)> {
        Some(match self.next_raw()? {
            Raw::Other(key, value) => (*key, value.clone()),
            Raw::Addr(key) => (key, None),
            Raw::Listed(key, target) => (key, Some(key.list_value(target))),
        })
    }
}

/// The keys of an [`ElementMap`] in key order (no value is cloned).
pub struct Keys<'a>(Iter<'a>);

impl Iterator for Keys<'_> {
    type Item = Key;

    fn next(&mut self) -> Option<Key> {
        Some(match self.0.next_raw()? {
            Raw::Other(key, _) => *key,
            Raw::Addr(key) | Raw::Listed(key, _) => key,
        })
    }
}

#[cfg(test)]
#[path = "elements_tests.rs"]
mod tests;
