//! Which region of which endpoint map each Service chain's endpoints live in.
//!
//! A Service chain that DNATs through an endpoint map ([`Action::DnatSlot`]) names its region in
//! its one rule, so the region must stay the chain's for as long as the chain exists: moving it
//! would rewrite the rule, and any rule written makes nf_tables re-validate the whole table.
//! Regions are therefore assigned once and kept, and released when the chain goes away. The map
//! is chosen by a hash of the chain name, the region is the lowest free one in it.
//!
//! [`Action::DnatSlot`]: crate::nft::ruleset::Action::DnatSlot

use std::collections::HashMap;

use crate::nft::ruleset::{ChainName, ENDPOINT_MAPS, SLOT_REGIONS_PER_MAP, endpoint_map_name};

const WORDS_PER_MAP: usize = (SLOT_REGIONS_PER_MAP / 64) as usize;

/// A region of an endpoint map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot {
    pub map: usize,
    pub region: u32,
}

impl Slot {
    pub fn map_name(self) -> &'static str {
        endpoint_map_name(self.map)
    }
}

/// The regions in use, by chain.
#[derive(Clone, Debug, Default)]
pub struct Slots {
    by_chain: HashMap<ChainName, Slot>,
    /// Per map, one bit per region.
    used: Vec<[u64; WORDS_PER_MAP]>,
}

/// The endpoint map a chain's region is taken from (FNV-1a of the name: stable across
/// processes and versions, unlike std's hasher).
pub fn map_of(chain: &str) -> usize {
    let mut h: u32 = 0x811c_9dc5;
    for b in chain.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h as usize % ENDPOINT_MAPS
}

impl Slots {
    pub fn new() -> Slots {
        Slots::default()
    }

    pub fn get(&self, chain: &str) -> Option<Slot> {
        self.by_chain.get(chain).copied()
    }

    /// Map `map`'s bits, every map's being allocated on first use.
    fn bits(&mut self, map: usize) -> &mut [u64; WORDS_PER_MAP] {
        if self.used.is_empty() {
            self.used = vec![[0; WORDS_PER_MAP]; ENDPOINT_MAPS];
        }
        &mut self.used[map]
    }

    /// The chain's region, assigning the lowest free one of its map if it has none yet; `None`
    /// when that map is full.
    pub fn assign(&mut self, chain: &ChainName) -> Option<Slot> {
        if let Some(slot) = self.get(chain) {
            return Some(slot);
        }
        let map = map_of(chain);
        let (w, word) = self
            .bits(map)
            .iter_mut()
            .enumerate()
            .find(|(_, w)| **w != u64::MAX)?;
        let bit = word.trailing_ones();
        *word |= 1 << bit;
        let slot = Slot {
            map,
            region: w as u32 * 64 + bit,
        };
        self.by_chain.insert(chain.clone(), slot);
        Some(slot)
    }

    /// Gives `chain` `slot` (as a previous run of the agent did), unless the chain already has
    /// a region or the region is taken.
    pub fn seed(&mut self, chain: &ChainName, slot: Slot) {
        if slot.map >= ENDPOINT_MAPS
            || slot.region >= SLOT_REGIONS_PER_MAP
            || self.by_chain.contains_key(chain)
        {
            return;
        }
        let (w, mask) = word_and_mask(slot.region);
        let word = &mut self.bits(slot.map)[w];
        if *word & mask == 0 {
            *word |= mask;
            self.by_chain.insert(chain.clone(), slot);
        }
    }

    /// Frees the chain's region, if it has one.
    pub fn release(&mut self, chain: &str) {
        if let Some(slot) = self.by_chain.remove(chain) {
            let (w, mask) = word_and_mask(slot.region);
            self.bits(slot.map)[w] &= !mask;
        }
    }

    /// Frees the regions of every chain `keep` says no to.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let gone: Vec<ChainName> = self.by_chain.keys().filter(|c| !keep(c)).cloned().collect();
        for chain in gone {
            self.release(&chain);
        }
    }
}

/// Where region `region`'s bit is in its map's words.
fn word_and_mask(region: u32) -> (usize, u64) {
    (region as usize / 64, 1 << (region % 64))
}

/// How a Service's part gets its chains' regions: a part being added may be assigned new ones,
/// a part being rebuilt to be taken out must see exactly the regions it was given.
pub enum SlotSource<'a> {
    Assign(&'a mut Slots),
    Lookup(&'a Slots),
}

impl SlotSource<'_> {
    pub fn pick(&mut self, chain: &ChainName) -> Option<Slot> {
        match self {
            SlotSource::Assign(slots) => slots.assign(chain),
            SlotSource::Lookup(slots) => slots.get(chain),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> ChainName {
        s.into()
    }

    #[test]
    fn regions_are_kept_reused_and_bounded() {
        let mut slots = Slots::new();
        let a = slots.assign(&name("service-a")).unwrap();
        assert_eq!(slots.assign(&name("service-a")), Some(a));
        assert_eq!(slots.get("service-a"), Some(a));
        slots.release("service-a");
        assert_eq!(slots.get("service-a"), None);
        // The freed region is the lowest free one again.
        assert_eq!(slots.assign(&name("service-a")), Some(a));

        // Fill one map: every chain hashing to it gets a distinct region until none is left.
        let map = map_of("service-a");
        let mut regions = std::collections::BTreeSet::new();
        regions.insert(a.region);
        let mut i = 0;
        while regions.len() < SLOT_REGIONS_PER_MAP as usize {
            let chain = name(&format!("service-{i}"));
            i += 1;
            if map_of(&chain) != map {
                continue;
            }
            let slot = slots.assign(&chain).unwrap();
            assert_eq!(slot.map, map);
            assert!(regions.insert(slot.region), "region given twice");
        }
        let full = (i..)
            .map(|i| name(&format!("service-{i}")))
            .find(|c| map_of(c) == map)
            .unwrap();
        assert_eq!(slots.assign(&full), None);
        slots.retain(|c| c != "service-a");
        assert_eq!(slots.assign(&full), Some(a));
    }

    #[test]
    fn seeds_are_kept_unless_taken() {
        let mut slots = Slots::new();
        let a = name("service-a");
        let map = map_of(&a);
        slots.seed(&a, Slot { map, region: 7 });
        assert_eq!(slots.assign(&a), Some(Slot { map, region: 7 }));
        // Taken region, out-of-range region: ignored.
        let b = name("service-b");
        slots.seed(&b, Slot { map, region: 7 });
        slots.seed(
            &b,
            Slot {
                map,
                region: SLOT_REGIONS_PER_MAP,
            },
        );
        assert_eq!(slots.get(&b), None);
        // New chains fill the lowest free regions around the seeded one.
        assert_eq!(slots.assign(&b).map(|s| s.region), Some(0));
    }
}
