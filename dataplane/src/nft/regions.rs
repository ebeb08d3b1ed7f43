//! Which region of which endpoint map each Service chain's endpoints live in.
//!
//! A Service chain that DNATs through an endpoint map ([`Action::DnatRegion`]) names its region in
//! its one rule, so the region must stay the chain's for as long as the chain exists: moving it
//! would rewrite the rule, and any rule written makes nf_tables re-validate the whole table.
//! Regions are therefore assigned once and kept, and released when the chain goes away. The map
//! is chosen by a hash of the chain name, the region is the lowest free one in it.
//!
//! [`Action::DnatRegion`]: crate::nft::ruleset::Action::DnatRegion

use std::collections::HashMap;

use crate::nft::ruleset::{ChainName, ENDPOINT_MAPS, REGIONS_PER_MAP, endpoint_map_name};

const WORDS_PER_MAP: usize = (REGIONS_PER_MAP / 64) as usize;

/// A region of an endpoint map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Region {
    pub map: usize,
    pub region: u32,
}

impl Region {
    pub fn map_name(self) -> &'static str {
        endpoint_map_name(self.map)
    }
}

/// The regions in use, by chain.
#[derive(Clone, Debug, Default)]
pub struct Regions {
    by_chain: HashMap<ChainName, Region>,
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

impl Regions {
    pub fn new() -> Regions {
        Regions::default()
    }

    pub fn get(&self, chain: &str) -> Option<Region> {
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
    pub fn assign(&mut self, chain: &ChainName) -> Option<Region> {
        if let Some(region) = self.get(chain) {
            return Some(region);
        }
        let map = map_of(chain);
        let (w, word) = self
            .bits(map)
            .iter_mut()
            .enumerate()
            .find(|(_, w)| **w != u64::MAX)?;
        let bit = word.trailing_ones();
        *word |= 1 << bit;
        let region = Region {
            map,
            region: w as u32 * 64 + bit,
        };
        self.by_chain.insert(chain.clone(), region);
        Some(region)
    }

    /// Gives `chain` `region` (as a previous run of the agent did), unless the chain already has
    /// a region or the region is taken.
    pub fn seed(&mut self, chain: &ChainName, region: Region) {
        if region.map >= ENDPOINT_MAPS
            || region.region >= REGIONS_PER_MAP
            || self.by_chain.contains_key(chain)
        {
            return;
        }
        let (w, mask) = word_and_mask(region.region);
        let word = &mut self.bits(region.map)[w];
        if *word & mask == 0 {
            *word |= mask;
            self.by_chain.insert(chain.clone(), region);
        }
    }

    /// Frees the chain's region, if it has one.
    pub fn release(&mut self, chain: &str) {
        if let Some(region) = self.by_chain.remove(chain) {
            let (w, mask) = word_and_mask(region.region);
            self.bits(region.map)[w] &= !mask;
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

/// How a Service's fragment gets its chains' regions: a fragment being added may be assigned new ones,
/// a fragment being rebuilt to be taken out must see exactly the regions it was given.
pub enum RegionSource<'a> {
    Assign(&'a mut Regions),
    Lookup(&'a Regions),
}

impl RegionSource<'_> {
    pub fn pick(&mut self, chain: &ChainName) -> Option<Region> {
        match self {
            RegionSource::Assign(regions) => regions.assign(chain),
            RegionSource::Lookup(regions) => regions.get(chain),
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
        let mut regions = Regions::new();
        let a = regions.assign(&name("service-a")).unwrap();
        assert_eq!(regions.assign(&name("service-a")), Some(a));
        assert_eq!(regions.get("service-a"), Some(a));
        regions.release("service-a");
        assert_eq!(regions.get("service-a"), None);
        // The freed region is the lowest free one again.
        assert_eq!(regions.assign(&name("service-a")), Some(a));

        // Fill one map: every chain hashing to it gets a distinct region until none is left.
        let map = map_of("service-a");
        let mut seen = std::collections::BTreeSet::new();
        seen.insert(a.region);
        let mut i = 0;
        while seen.len() < REGIONS_PER_MAP as usize {
            let chain = name(&format!("service-{i}"));
            i += 1;
            if map_of(&chain) != map {
                continue;
            }
            let region = regions.assign(&chain).unwrap();
            assert_eq!(region.map, map);
            assert!(seen.insert(region.region), "region given twice");
        }
        let full = (i..)
            .map(|i| name(&format!("service-{i}")))
            .find(|c| map_of(c) == map)
            .unwrap();
        assert_eq!(regions.assign(&full), None);
        regions.retain(|c| c != "service-a");
        assert_eq!(regions.assign(&full), Some(a));
    }

    #[test]
    fn seeds_are_kept_unless_taken() {
        let mut regions = Regions::new();
        let a = name("service-a");
        let map = map_of(&a);
        regions.seed(&a, Region { map, region: 7 });
        assert_eq!(regions.assign(&a), Some(Region { map, region: 7 }));
        // Taken region, out-of-range region: ignored.
        let b = name("service-b");
        regions.seed(&b, Region { map, region: 7 });
        regions.seed(
            &b,
            Region {
                map,
                region: REGIONS_PER_MAP,
            },
        );
        assert_eq!(regions.get(&b), None);
        // New chains fill the lowest free regions around the seeded one.
        assert_eq!(regions.assign(&b).map(|s| s.region), Some(0));
    }
}
