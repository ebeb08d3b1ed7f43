//! The desired table of one family, kept up to date Service by Service.
//!
//! A full [`build`](crate::nft::build::build) costs O(cluster). The agent instead keeps the desired
//! table between syncs and, when a few Services change, removes what they contributed and adds
//! what they contribute now, or rather only what differs between the two
//! ([`crate::nft::build::diff`]): O(changed Services), and for a large Service's endpoint change
//! a few elements. It also returns the [`Scope`] of the change, the chains, sets and map
//! elements that may differ, so that planning is O(change) as well.
//!
//! The result is always the table a full build would give, except for which endpoint-map region
//! a Service chain uses, the sets' sizes and the order of large Services' endpoints: regions are
//! kept for as long as their chain exists (see [`crate::nft::regions`]), sizes for as long as
//! they fit (see [`crate::nft::ruleset::Table::fit_set_sizes`]) and an endpoint's index in a
//! flat-path list for as long as it is in the list (see [`Fragment::keep_big_order`]), so after
//! changes all three may differ from a fresh build's (and a build at startup adopts the
//! kernel's). Elements of plain sets may be shared (an
//! endpoint of several Services is one `hairpin-endpoints` element): they are counted and stay
//! while any Service claims them.
//!
//! Services claiming the same frontend (a ClusterIP, or an external or load-balancer IP with a
//! port) are decided by [`crate::conflicts`] before any element is made, so no two Services
//! claim one element of a map with values. A Service's part therefore depends on the
//! Services it shares an address with: when one of them changes, [`Desired::update`] re-plans
//! those whose conflicts come out differently too (found through the model's address index,
//! O(claimants)), taking every old part out before putting any new part in, as a frontend may
//! move from one Service to another. Only two Services with one NodePort still claim one
//! element; that rare conflict makes [`Desired::update`] rebuild everything.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use foldhash::fast::RandomState;
use ipnet::IpNet;

use crate::conflicts::{Suppressed, claims_differ, neighbours, suppressed};
use crate::model::{Cluster, Node, ObjectName};
use crate::nft::build::{
    BuildConfig, BuildEnv, Fragment, NoLocalEndpoints, affinity, base_table, diff, service_fragment,
};
use crate::nft::regions::{RegionSource, Regions};
use crate::nft::ruleset::{
    ChainName, ElementMap, Family, Key, KeyType, Set, SetDecl, Table, Value,
};
use crate::nft::state::TableState;

pub use crate::nft::ruleset::{Delta, Touched, Was};

/// What an incremental update touched: everything a planner must compare.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    pub chains: BTreeSet<ChainName>,
    /// Sets owned by one Service (affinity sets), compared whole.
    pub sets: BTreeSet<String>,
    /// The elements touched (of shared maps, and of the sets above), with what they were.
    pub elements: Delta,
}

impl Scope {
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.sets.is_empty() && self.elements.is_empty()
    }

    fn cover(&mut self, part: &Fragment) {
        self.chains.extend(part.chains.keys().cloned());
        self.sets.extend(part.sets.keys().cloned());
    }

    /// Records what the elements of `part`'s own sets (replaced whole) are in `table` now,
    /// unless an earlier step of the same change recorded them already: call before `part` is
    /// added or taken out. Its elements of shared maps are recorded as they are put in or taken
    /// out ([`Desired::insert`], [`Desired::remove`]), which tells what each was anyway.
    fn note_own_sets(&mut self, table: &Table, part: &Fragment) {
        for (name, set) in &part.sets {
            let now = table.sets.get(name);
            let keys: Vec<Key> = set
                .elements
                .keys()
                .chain(now.into_iter().flat_map(|s| s.elements.keys()))
                .collect();
            let entries = match now {
                Some(s) => keys
                    .iter()
                    .copied()
                    .zip(s.elements.get_each(&keys))
                    .collect(),
                None => keys.into_iter().map(|key| (key, None)).collect(),
            };
            self.record(name, entries);
        }
    }

    /// Records what `entries` of `set` were, but for keys recorded already ([`Touched::record`]).
    fn record(&mut self, set: &str, entries: Vec<(Key, Was)>) {
        self.record_with(set, |noted| noted.extend(entries));
    }

    /// Records what the entries `fill` pushes were ([`Touched::record_with`]).
    fn record_with(&mut self, set: &str, fill: impl FnOnce(&mut Vec<(Key, Was)>)) {
        if let Some(noted) = self.elements.get_mut(set) {
            noted.record_with(fill);
            return;
        }
        let mut noted = Touched::default();
        noted.record_with(fill);
        if !noted.is_empty() {
            self.elements.insert(set.to_string(), noted);
        }
    }
}

/// Where a planner finds the elements of the sets the committed state marks as the previous
/// desired table's ([`crate::nft::state::Elements::Desired`]) after [`Desired::update`] or a
/// rebuild.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Before {
    /// They are the desired table's, but for these elements.
    Delta(Delta),
    /// They are these sets' (the desired table before it was rebuilt).
    Sets(BTreeMap<String, Set>),
    /// Not known: the state holds no such set (it was read back, or there is none).
    Nothing,
}

/// The outcome of [`Desired::update`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Updated {
    /// Only this scope may differ from the previous desired table.
    Scope(Scope),
    /// Everything was rebuilt, or a set resized: plan the whole table.
    All(Before),
}

/// The cluster-wide inputs of every Service's part: when they change, everything is rebuilt.
#[derive(Clone, Debug, PartialEq, Eq)]
struct NodeInputs {
    node: Option<Node>,
    service_cidrs: Vec<IpNet>,
}

impl NodeInputs {
    fn of(cluster: &Cluster, family: Family) -> NodeInputs {
        NodeInputs {
            node: cluster.node.clone(),
            service_cidrs: cluster.service_cidrs(family),
        }
    }
}

/// One family's desired table and, per Service, what it contributed.
#[derive(Clone, Debug)]
pub struct Desired {
    table: Table,
    /// The configuration and node-wide inputs the table was built for.
    config: BuildConfig,
    inputs: NodeInputs,
    /// The model the table was built from. What a changed Service contributed before is
    /// rebuilt from it, to be compared with what it contributes now. The model is persistent, so this copy
    /// shares everything but what changed since (keeping each Service's keys instead cost
    /// about 500 bytes per Service).
    built_from: Cluster,
    /// Shared-map elements claimed by more than one Service, with the number of claimants
    /// beyond the first. An element in the table and not here has exactly one claimant (almost
    /// all of them: counting every element would cost as much memory as the elements).
    shared: HashMap<(&'static str, Key), u32>,
    /// Whether `shared` may hold an element with a value (two Services with one NodePort,
    /// after a build): updates then check the elements a Service keeps as well.
    shared_values: bool,
    /// The Service chains' endpoint-map regions.
    regions: Regions,
    rules: usize,
    elements: usize,
    no_local_endpoints: NoLocalEndpoints,
}

impl Desired {
    /// Builds the whole table (O(cluster)).
    pub fn build(cluster: &Cluster, config: &BuildConfig, family: Family) -> Desired {
        Desired::build_keeping(cluster, config, family, Regions::new(), |_| None, |_| None)
    }

    /// Builds the whole table, giving chains the endpoint-map regions they have in `kernel`
    /// (what a previous run programmed) where possible, so that their rules stay as they are.
    pub fn build_adopting(
        cluster: &Cluster,
        config: &BuildConfig,
        family: Family,
        kernel: &TableState,
    ) -> Desired {
        let mut regions = Regions::new();
        for (chain, state) in &kernel.chains {
            if let Some(region) = state.region {
                regions.seed(chain, region);
            }
        }
        Desired::build_keeping(
            cluster,
            config,
            family,
            regions,
            |name| kernel.sets.get(name)?.decl.size,
            |name| kernel.sets.get(name)?.elements.read(),
        )
    }

    /// Builds the whole table, keeping the regions `regions` gave chains that still exist, the
    /// set sizes `sizes` gives that still fit, and the order of the flat-path endpoint lists
    /// `before` gives (the elements a set held: see [`Fragment::keep_big_order`]).
    fn build_keeping<'a>(
        cluster: &Cluster,
        config: &BuildConfig,
        family: Family,
        regions: Regions,
        sizes: impl Fn(&str) -> Option<u32>,
        before: impl Fn(&str) -> Option<&'a ElementMap>,
    ) -> Desired {
        let table = base_table(config, cluster, family);
        let mut desired = Desired {
            rules: table.chains.values().map(|c| c.rules.len()).sum(),
            elements: table.sets.values().map(|s| s.elements.len()).sum(),
            table,
            config: config.clone(),
            inputs: NodeInputs::of(cluster, family),
            built_from: cluster.clone(),
            shared: HashMap::new(),
            shared_values: false,
            regions,
            no_local_endpoints: NoLocalEndpoints::default(),
        };
        let env = BuildEnv::new(cluster, config, family);
        // Elements are gathered per set and put in place at the end, sorted: inserting 400k
        // elements one by one into B-trees (and repacking them) cost more than building the
        // rest of the table.
        let mut gathered: HashMap<&'static str, Vec<(Key, Option<Value>)>, RandomState> =
            HashMap::default();
        for svc in cluster.services.values() {
            let mut part = service_fragment(
                svc,
                cluster.slices_of(&svc.name),
                &env,
                &mut RegionSource::Assign(&mut desired.regions),
                &suppressed(&cluster.services, svc),
            );
            part.keep_big_order(&before);
            for secs in part.affinity_timeouts() {
                desired.rules += affinity::add_timeout(&mut desired.table, secs);
            }
            desired.insert_structure(&part);
            for (set, key, value) in part.all_elements() {
                gathered.entry(set).or_default().push((key, value));
            }
        }
        for (set, elements) in gathered {
            desired.insert_gathered(set, elements);
        }
        let sets = &desired.table.sets;
        desired.shared_values = desired.shared.keys().any(|(set, key)| {
            sets.get(*set)
                .and_then(|s| s.elements.get(key))
                .is_some_and(|value| value.is_some())
        });
        let chains = &desired.table.chains;
        desired.regions.retain(|chain| chains.contains_key(chain));
        desired.table.fit_set_sizes(sizes);
        // Filled in no key order, the chains' B-tree nodes end up about two-thirds full;
        // rebuilt from their sorted contents they are full.
        desired.table.chains = std::mem::take(&mut desired.table.chains)
            .into_iter()
            .collect();
        desired
    }

    /// Puts the elements services claimed in `set`, in build order, into the table: where
    /// several claim an element, the last one's value stands, as in a full build, and the
    /// others count as sharing it.
    fn insert_gathered(&mut self, set: &'static str, mut elements: Vec<(Key, Option<Value>)>) {
        let Some(s) = self.table.sets.get_mut(set) else {
            return; // As `merge_into`: elements of maps the table lacks are ignored.
        };
        // Stable: claimants of one element stay in build order, and the last one's value stays.
        elements.sort_by_key(|e| e.0);
        let shared = &mut self.shared;
        elements.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                kept.1 = later.1.take();
                *shared.entry((set, kept.0)).or_insert(0) += 1;
            }
            same
        });
        if s.elements.is_empty() {
            self.elements += elements.len();
            s.elements = Arc::new(ElementMap::from_sorted(elements));
            return;
        }
        for (key, value) in elements {
            if s.elements_mut().insert(key, value).is_some() {
                *self.shared.entry((set, key)).or_insert(0) += 1;
            } else {
                self.elements += 1;
            }
        }
    }

    pub fn family(&self) -> Family {
        self.table.family
    }

    pub fn table(&self) -> &Table {
        &self.table
    }

    pub fn no_local_endpoints(&self) -> NoLocalEndpoints {
        self.no_local_endpoints
    }

    /// (chains, rules, sets, set elements) of the table, kept as counts so that reporting them
    /// costs nothing.
    pub fn object_counts(&self) -> (usize, usize, usize, usize) {
        (
            self.table.chains.len(),
            self.rules,
            self.table.sets.len(),
            self.elements,
        )
    }

    /// Brings the table up to date with `cluster` for the Services in `changed` (created,
    /// updated or deleted ones alike; their EndpointSlices included). The Services sharing a
    /// frontend address with a changed one are re-planned too where their conflicts come out
    /// differently. Anything node-wide that changed (configuration, Node, ServiceCIDRs)
    /// rebuilds everything, as does a NodePort claimed by two Services.
    pub fn update<'a>(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        changed: impl IntoIterator<Item = &'a ObjectName>,
    ) -> Updated {
        let family = self.family();
        if *config != self.config || NodeInputs::of(cluster, family) != self.inputs {
            return Updated::All(Before::Sets(self.rebuild(cluster, config)));
        }
        // The node-wide inputs are unchanged, so the environment is the one the table was
        // built in, and rebuilding a Service's part from `built_from` gives what it added then.
        let env = BuildEnv::new(cluster, config, family);
        let changed: BTreeSet<&ObjectName> = changed.into_iter().collect();
        let affected = self.affected(cluster, &changed);
        let after = cluster;
        let mut scope = Scope::default();
        let mut contested = false;
        // Every old part goes before any new part comes in: a frontend may move from one
        // Service to another.
        let mut released: BTreeSet<ChainName> = BTreeSet::new();
        // Each Service's old and new part, reduced to what differs (the new flat-path lists in
        // the table's order): a large Service's endpoint change touches a few elements.
        let mut changes = Vec::new();
        for (name, (old, new)) in &affected {
            let table = &self.table;
            let before = |set: &str| table.sets.get(set).map(|s| &*s.elements);
            let old = self.built_from.services.get(name).map(|svc| {
                service_fragment(
                    svc,
                    self.built_from.slices_of(name),
                    &env,
                    &mut RegionSource::Lookup(&self.regions),
                    old,
                )
            });
            // An element the Service keeps is not taken out, so its claim is not checked
            // there: with map elements claimed twice, check them all (as `remove` does).
            if self.shared_values
                && let Some(old) = &old
            {
                contested |= old.all_elements().any(|(set, key, value)| {
                    value.is_some() && self.shared.contains_key(&(set, key))
                });
            }
            let new = after.services.get(name).map(|svc| {
                service_fragment(
                    svc,
                    after.slices_of(name),
                    &env,
                    &mut RegionSource::Assign(&mut self.regions),
                    new,
                )
            });
            changes.push(match (old, new) {
                (Some(old), Some(new)) => {
                    let (gone, came) = diff::changes(old, new, before);
                    (Some(gone), Some(came))
                }
                (old, Some(mut new)) => {
                    new.keep_big_order(before);
                    (old, Some(new))
                }
                other => other,
            });
        }
        // A session-affinity timeout no Service had before needs record rules of its own
        // (see `affinity`): rare enough to rebuild for, as is the last Service of a timeout
        // leaving (below).
        let new_timeout = changes
            .iter()
            .filter_map(|(_, came)| came.as_ref())
            .flat_map(Fragment::affinity_timeouts)
            .any(|secs| !self.table.sets.contains_key(affinity::timeout_sets(secs).0));
        if new_timeout {
            return Updated::All(Before::Sets(self.rebuild(cluster, config)));
        }
        let old_timeouts: BTreeSet<u32> = changes
            .iter()
            .filter_map(|(gone, _)| gone.as_ref())
            .flat_map(Fragment::affinity_timeouts)
            .collect();
        for gone in changes.iter().filter_map(|(gone, _)| gone.as_ref()) {
            scope.note_own_sets(&self.table, gone);
            contested |= self.remove(gone, &mut scope);
            scope.cover(gone);
            released.extend(gone.chains.keys().cloned());
        }
        for came in changes.iter().filter_map(|(_, came)| came.as_ref()) {
            scope.cover(came);
            scope.note_own_sets(&self.table, came);
            contested |= self.insert(came, &mut scope);
            for chain in came.chains.keys() {
                released.remove(chain);
            }
        }
        for chain in &released {
            self.regions.release(chain);
        }
        let unused = |secs: u32| {
            let (services, nodeports) = affinity::timeout_sets(secs);
            [services, nodeports].iter().all(|set| {
                self.table
                    .sets
                    .get(*set)
                    .is_none_or(|s| s.elements.is_empty())
            })
        };
        if contested || old_timeouts.into_iter().any(unused) {
            if contested {
                tracing::debug!(
                    family = family.k8s_name(),
                    "two Services claim one map element: rebuilding the desired table"
                );
            }
            revert(&mut self.table.sets, &scope.elements);
            return Updated::All(Before::Sets(self.rebuild(cluster, config)));
        }
        self.built_from = cluster.clone();
        // A set that outgrew its size (or shrank far below it) is recreated with a new one,
        // which rewrites the chains that use it: plan everything.
        let touched = scope.elements.keys().chain(&scope.sets).map(String::as_str);
        if !self.table.set_sizes_fit(touched) {
            self.table.fit_set_sizes(|_| None);
            return Updated::All(Before::Delta(scope.elements));
        }
        Updated::Scope(scope)
    }

    /// The Services whose parts an update for `changed` re-plans, with what each may not
    /// program before (in `built_from`) and now (in `cluster`): the changed ones, and those
    /// of their neighbours (Services sharing an address with one, before or now) whose
    /// conflicts come out differently. O(changed × claimants).
    fn affected(
        &self,
        cluster: &Cluster,
        changed: &BTreeSet<&ObjectName>,
    ) -> BTreeMap<ObjectName, (Suppressed, Suppressed)> {
        let (before, after) = (&self.built_from.services, &cluster.services);
        let resolve = |name: &ObjectName| {
            let of = |services: &crate::model::Services| {
                services
                    .get(name)
                    .map_or(Suppressed::NONE, |svc| suppressed(services, svc))
            };
            (of(before), of(after))
        };
        let mut affected: BTreeMap<ObjectName, (Suppressed, Suppressed)> = changed
            .iter()
            .map(|name| ((*name).clone(), resolve(name)))
            .collect();
        for name in changed {
            let (old, new) = (before.get(name), after.get(name));
            if !claims_differ(old.map(|s| &**s), new.map(|s| &**s)) {
                continue;
            }
            let around = old
                .into_iter()
                .flat_map(|svc| neighbours(before, svc))
                .chain(new.into_iter().flat_map(|svc| neighbours(after, svc)));
            for svc in around {
                if affected.contains_key(&svc.name) {
                    continue;
                }
                let (old, new) = resolve(&svc.name);
                if old != new {
                    affected.insert(svc.name.clone(), (old, new));
                }
            }
        }
        affected
    }

    /// Rebuilds everything (O(cluster)), keeping the chains' endpoint-map regions and the set
    /// sizes that still fit. Returns the sets of the table before, for the planner.
    pub fn rebuild(&mut self, cluster: &Cluster, config: &BuildConfig) -> BTreeMap<String, Set> {
        let regions = std::mem::take(&mut self.regions);
        let old = std::mem::take(&mut self.table.sets);
        *self = Desired::build_keeping(
            cluster,
            config,
            self.family(),
            regions,
            |name| old.get(name)?.decl.size,
            |name| old.get(name).map(|s| &*s.elements),
        );
        old
    }

    /// Adds a Service's part; true if another Service already claims one of its elements.
    /// (What [`Fragment::merge_into`] does, counting as it goes.) `scope` records what each
    /// element of a shared map was.
    fn insert(&mut self, part: &Fragment, scope: &mut Scope) -> bool {
        let mut contested = false;
        self.insert_structure(part);
        let Desired {
            table,
            shared,
            elements,
            ..
        } = self;
        for (name, run) in part.element_runs() {
            // Elements of maps the table lacks are ignored, as by `merge_into`.
            let Some(set) = table.sets.get_mut(name) else {
                continue;
            };
            scope.record_with(name, |touched| {
                touched.reserve(run.len());
                set.elements_mut().insert_each(run, |key, has_value, was| {
                    match was {
                        Some(_) => {
                            *shared.entry((name, key)).or_insert(0) += 1;
                            // Plain-set elements (e.g. an endpoint shared by two Services)
                            // carry no value to disagree on; map elements do.
                            contested |= has_value;
                        }
                        None => *elements += 1,
                    }
                    touched.push((key, was));
                });
            });
        }
        contested
    }

    /// Adds a Service's part but for its elements of shared maps.
    fn insert_structure(&mut self, part: &Fragment) {
        part.merge_structure_into(&mut self.table);
        self.elements += part.sets.values().map(|s| s.elements.len()).sum::<usize>();
        self.rules += rules_of(part);
        self.no_local_endpoints.add(part.no_local_endpoints);
    }

    /// Takes a Service's part out again; true if another Service still claims one of its
    /// elements (whose value only a rebuild can tell). `scope` records what each element of a
    /// shared map taken out was (one another Service keeps does not change).
    fn remove(&mut self, part: &Fragment, scope: &mut Scope) -> bool {
        let mut contested = false;
        for chain in part.chains.keys() {
            self.table.chains.remove(chain);
        }
        for set in part.sets.keys() {
            if let Some(s) = self.table.sets.remove(set) {
                self.elements -= s.elements.len();
            }
        }
        let Desired {
            table,
            shared,
            elements,
            ..
        } = self;
        for (name, mut run) in part.key_runs() {
            // An element another Service claims too stays, with one claimant fewer.
            run.retain(|key| {
                let Some(others) = shared.get_mut(&(name, *key)) else {
                    return true;
                };
                *others -= 1;
                if *others == 0 {
                    shared.remove(&(name, *key));
                }
                contested |= table
                    .sets
                    .get(name)
                    .and_then(|s| s.elements.get(key))
                    .is_some_and(|value| value.is_some());
                false
            });
            let Some(set) = table.sets.get_mut(name) else {
                continue;
            };
            let endpoint_map = run
                .first()
                .is_some_and(|key| key.key_type() == KeyType::Interval);
            scope.record_with(name, |touched| {
                touched.reserve(run.len());
                set.elements_mut().remove_each(run, |key, was| {
                    *elements -= usize::from(was.is_some());
                    touched.push((key, was));
                });
            });
            // An endpoint map exists while it has elements, as in a full build.
            if endpoint_map && set.elements.is_empty() {
                table.sets.remove(name);
            }
        }
        self.rules -= rules_of(part);
        self.no_local_endpoints.sub(part.no_local_endpoints);
        contested
    }
}

/// Gives `sets` back the elements `delta` says they had (only the elements matter: a set that
/// was taken out is put back with a placeholder declaration).
fn revert(sets: &mut BTreeMap<String, Set>, delta: &Delta) {
    for (name, keys) in delta {
        for (key, was) in keys {
            match was {
                Some(value) => {
                    let set = sets.entry(name.clone()).or_insert_with(|| {
                        Set::new(SetDecl::new(key.key_type()), ElementMap::new())
                    });
                    set.elements_mut().insert(*key, value.clone());
                }
                None => {
                    if let Some(set) = sets.get_mut(name) {
                        set.elements_mut().remove(key);
                    }
                }
            }
        }
    }
}

fn rules_of(part: &Fragment) -> usize {
    part.chains.values().map(|c| c.rules.len()).sum()
}
