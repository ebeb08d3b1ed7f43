//! What changed between two parts of one Service, so that an update touches only that: an
//! endpoint change on a Service of thousands of endpoints then adds, replaces and deletes a few
//! elements instead of taking thousands out and putting them back (docs/performance.md, "Partial
//! syncs of large Services: the agent's part").

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use super::big::{address_key, kept_order, reorder};
use super::{BigList, Fragment, HAIRPIN_ENDPOINTS};
use crate::nft::ruleset::{ElementMap, Key, Target};

/// The part of a Service to take out (`gone`) and to put in (`came`) to turn its old part into
/// its new one. Both keep their chains, sets and no-local-endpoint counts whole (chains are
/// compared by the planner, and few); of the elements, `gone` holds the old ones the new part
/// lacks or maps to another value, `came` the new ones the old part lacks or maps to another
/// value. Elements both parts hold alike are in neither.
///
/// `before` gives the elements the table holds now: the new part's flat-path lists keep their
/// endpoints' indices from it ([`Fragment::keep_big_order`]), so that an endpoint change is a
/// few elements.
pub fn changes<'a>(
    old: Fragment,
    new: Fragment,
    before: impl Fn(&str) -> Option<&'a ElementMap>,
) -> (Fragment, Fragment) {
    let mut gone = Fragment {
        chains: old.chains,
        sets: old.sets,
        no_local_endpoints: old.no_local_endpoints,
        ..Fragment::default()
    };
    let mut came = Fragment {
        chains: new.chains,
        sets: new.sets,
        no_local_endpoints: new.no_local_endpoints,
        ..Fragment::default()
    };
    for (key, value) in &old.elements {
        if new.elements.get(key) != Some(value) {
            gone.elements.insert(*key, value.clone());
        }
    }
    for (key, value) in new.elements {
        if old.elements.get(&key) != Some(&value) {
            came.elements.insert(key, value);
        }
    }
    list_changes(&old.lists, new.lists, before, &mut gone, &mut came);
    hairpin_changes(&old.hairpin, &new.hairpin, &mut gone, &mut came);
    (gone, came)
}

/// Per destination, the entries whose endpoint differs by index, the new lists ordered as
/// [`Fragment::keep_big_order`] orders them. The old part's lists are in the builder's order,
/// not the table's; only their lengths are used: `before` (the table) has their order.
fn list_changes<'a>(
    old: &[BigList],
    new: Vec<BigList>,
    before: impl Fn(&str) -> Option<&'a ElementMap>,
    gone: &mut Fragment,
    came: &mut Fragment,
) {
    let mut old_len: BTreeMap<(&'static str, Key), usize> = old
        .iter()
        .map(|l| ((l.map, l.dest), l.endpoints.len()))
        .collect();
    // A port's lists at its ClusterIP, load-balancer IPs and NodePort, and those of its other
    // ports, usually hold the same addresses in the same order, before and after: the order is
    // worked out once per distinct pair of address sequences (what the table had, what the
    // builder lists), and the lists of the other ports take it with their own port numbers.
    let mut orders: Vec<Reordering> = Vec::new();
    for mut list in new {
        let had = old_len.remove(&(list.map, list.dest)).unwrap_or(0);
        let n = list.endpoints.len();
        let was = match before(list.map) {
            Some(elements) => elements.list_targets(list.dest, n.max(had)),
            None => vec![None; n.max(had)],
        };
        let seen = orders.iter().position(|(w, built, _)| {
            same_addresses(w, &was[..n], |t| t.map(|(a, _)| a))
                && same_addresses(built, &list.endpoints, |&(a, _)| Some(a))
        });
        let at = seen.unwrap_or_else(|| {
            let order = kept_order(&was[..n], &list.endpoints, address_key);
            orders.push((was[..n].to_vec(), list.endpoints.clone(), order));
            orders.len() - 1
        });
        if let Some(order) = &orders[at].2 {
            list.endpoints = reorder(&list.endpoints, order).into();
        }
        for (i, &(addr, port)) in (0u16..).zip(list.endpoints.iter()) {
            // Only the Service's own entries count as kept: a higher one the table has is
            // another Service's (a frontend moving over), which that Service takes out.
            let kept = usize::from(i) < had && was[usize::from(i)] == Some((addr, port));
            if !kept {
                let value = list.value((addr, port));
                came.elements.insert((list.map, list.entry(i)), Some(value));
                if usize::from(i) < had {
                    // Replaced: out and in again, as claims are counted.
                    gone.elements.insert((list.map, list.entry(i)), None);
                }
            }
        }
        for i in n..had {
            let i = u16::try_from(i).expect("a list index");
            gone.elements.insert((list.map, list.entry(i)), None);
        }
    }
    // Destinations the new part has no list for.
    for ((map, dest), had) in old_len {
        for i in 0..u16::try_from(had).expect("a list length") {
            let key = dest.list_entry(i).expect("a destination key");
            gone.elements.insert((map, key), None);
        }
    }
}

/// What a list's entries were in the table, the builder's list, and the order it is put in
/// (None: its own) by [`kept_order`].
type Reordering = (Vec<Option<Target>>, Arc<[Target]>, Option<Vec<usize>>);

/// Whether `a` and `b` list the same addresses (read by `addr`) in the same order.
fn same_addresses<T>(a: &[T], b: &[T], addr: impl Fn(&T) -> Option<IpAddr>) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| addr(x) == addr(y))
}

/// The endpoints only one of the (sorted) hairpin lists has.
fn hairpin_changes(old: &[IpAddr], new: &[IpAddr], gone: &mut Fragment, came: &mut Fragment) {
    let (mut a, mut b) = (old.iter().peekable(), new.iter().peekable());
    loop {
        let only = match (a.peek(), b.peek()) {
            (None, None) => return,
            (Some(x), Some(y)) if x == y => {
                a.next();
                b.next();
                continue;
            }
            (Some(x), Some(y)) if x < y => (&mut *gone, a.next()),
            (Some(_), None) => (&mut *gone, a.next()),
            _ => (&mut *came, b.next()),
        };
        if let (part, Some(ip)) = only {
            part.elements
                .insert((HAIRPIN_ENDPOINTS, Key::AddrPair(*ip)), None);
        }
    }
}
