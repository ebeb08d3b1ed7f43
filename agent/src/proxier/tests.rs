//! The nftables proxier on the fake kernel: partial syncs leave what a full one would, a
//! failure makes the next sync read the kernel back, a new proxier adopts what it finds, drift
//! is repaired, and a probe sees every phase.

use std::collections::BTreeSet;

use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::BuildConfig;
use dataplane::nft::ruleset::Family;

use super::testkit::{self, cluster, fake_syncer};
use super::*;
use crate::nftables::fake::FakeKernel;

fn config() -> BuildConfig {
    testkit::settings("1s", "30s").build
}

fn names(ids: &[u8]) -> BTreeSet<ObjectName> {
    ids.iter()
        .map(|i| ObjectName::new("ns", &format!("svc{i}")))
        .collect()
}

/// Syncs `family` of `syncer` after the Services `changed` changed; the report.
fn partial(syncer: &mut Syncer, c: &Cluster, changed: &[u8]) -> BTreeMap<Family, FamilyReport> {
    let changed = names(changed);
    let all = Family::ALL.iter().map(|f| (*f, false)).collect();
    syncer
        .sync_families(c, &config(), &all, ChangedServices::Services(&changed))
        .into_iter()
        .map(|(f, r)| (f, r.expect("the sync succeeds")))
        .collect()
}

/// Whether the kernel's table of `family` serves Service `svc{i}`.
fn serves(fake: &FakeKernel, family: Family, i: u8) -> bool {
    let frontend = match family {
        Family::V4 => format!("172.30.0.{i} . tcp . 80"),
        Family::V6 => format!("fd00::{i} . tcp . 80"),
    };
    fake.render(family).contains(&frontend)
}

fn assert_nothing_to_do(syncer: &mut Syncer, c: &Cluster) {
    for (family, report) in syncer.sync(c, &config(), true).expect("a full sync") {
        assert_eq!(report.ops, 0, "{family:?}: a full sync still finds work");
        assert!(!report.drift_repaired);
    }
}

#[test]
fn partial_syncs_leave_the_kernel_as_a_full_sync_would() {
    let fake = FakeKernel::new();
    let mut syncer = fake_syncer(&fake);
    let before = cluster(1..=5);
    syncer.sync(&before, &config(), true).expect("cold sync");
    let mut tracker = dataplane::tracker::Tracker::new(testkit::NODE, "");
    for i in [1, 3, 4, 5, 6] {
        let endpoints = if i == 3 { 20 } else { 1 };
        testkit::apply(&mut tracker, &testkit::service(i, endpoints, true));
    }
    let after = tracker.cluster().clone();
    fake.clear_log();
    let reports = partial(&mut syncer, &after, &[2, 3, 6]);
    for family in Family::ALL {
        assert!(reports[&family].ops > 0);
        assert!(serves(&fake, family, 6), "{family:?}");
        assert!(!serves(&fake, family, 2), "{family:?}");
        assert!(fake.render(family).contains("ns/svc3/"), "{family:?}");
    }
    // Only what changed was sent.
    let sent: usize = fake.transactions().iter().map(|r| r.tx.ops.len()).sum();
    let cold = {
        let other = FakeKernel::new();
        fake_syncer(&other).sync(&after, &config(), true).unwrap();
        other
            .transactions()
            .iter()
            .map(|r| r.tx.ops.len())
            .sum::<usize>()
    };
    assert!(sent < cold / 2, "sent {sent} ops, a cold sync {cold}");
    assert_nothing_to_do(&mut syncer, &after);
}

#[test]
fn a_failed_sync_makes_the_next_one_read_the_kernel_back() {
    let fake = FakeKernel::new();
    let mut syncer = fake_syncer(&fake);
    let before = cluster(1..=3);
    syncer.sync(&before, &config(), true).expect("cold sync");
    let reads = fake.reads();
    let after = cluster(1..=4);
    fake.break_family(Family::V4, Some(libc::EIO));
    let changed = names(&[4]);
    let all = Family::ALL.iter().map(|f| (*f, false)).collect();
    let results =
        syncer.sync_families(&after, &config(), &all, ChangedServices::Services(&changed));
    assert!(results[&Family::V4].is_err());
    assert!(
        results[&Family::V6].is_ok(),
        "the other family is not held up"
    );
    assert_eq!(fake.reads(), reads, "partial syncs read nothing");
    fake.break_family(Family::V4, None);
    // Asked for a partial sync with no change, the failed family still reads back and
    // rebuilds.
    let reports = partial(&mut syncer, &after, &[]);
    assert_eq!(fake.reads(), reads + 1);
    assert!(reports[&Family::V4].ops > 0);
    assert_eq!(reports[&Family::V6].ops, 0);
    assert!(serves(&fake, Family::V4, 4));
    assert_nothing_to_do(&mut syncer, &after);
}

#[test]
fn a_new_proxier_adopts_the_table_it_finds() {
    let fake = FakeKernel::new();
    let c = cluster(1..=4);
    fake_syncer(&fake)
        .sync(&c, &config(), true)
        .expect("first run");
    let tables = Family::ALL.map(|f| fake.render(f));
    fake.clear_log();
    let reports = fake_syncer(&fake)
        .sync(&c, &config(), true)
        .expect("second run");
    assert!(reports.values().all(|r| r.ops == 0), "{reports:?}");
    assert!(fake.transactions().is_empty());
    assert_eq!(Family::ALL.map(|f| fake.render(f)), tables);
}

#[test]
fn a_full_sync_repairs_drift() {
    let fake = FakeKernel::new();
    let mut syncer = fake_syncer(&fake);
    let c = cluster(1..=4);
    syncer.sync(&c, &config(), true).expect("cold sync");
    let table = fake.render(Family::V6);
    fake.tamper(Family::V6, |t| {
        let t = t.as_mut().expect("a table");
        t.sets
            .get_mut("cluster-ips")
            .expect("a set")
            .elements
            .clear();
    });
    assert_ne!(fake.render(Family::V6), table);
    let reports = syncer.sync(&c, &config(), true).expect("full sync");
    assert!(reports[&Family::V6].drift_repaired);
    assert!(!reports[&Family::V4].drift_repaired);
    assert_eq!(fake.render(Family::V6), table);
    // Someone deleting the whole table is repaired too.
    fake.tamper(Family::V4, |t| *t = None);
    let reports = syncer.sync(&c, &config(), true).expect("full sync");
    assert!(reports[&Family::V4].drift_repaired);
    assert_nothing_to_do(&mut syncer, &c);
}

#[derive(Default)]
struct Phases(Vec<(Family, Phase)>);

impl Probe for Phases {
    fn enter(&mut self, family: Family, phase: Phase) {
        self.0.push((family, phase));
    }
}

#[test]
fn a_probe_sees_each_phase_of_a_sync() {
    let fake = FakeKernel::new();
    let mut syncer = fake_syncer(&fake);
    let c = cluster(1..=2);
    let mut probe = Phases::default();
    let proxier = syncer.proxier(Family::V4).expect("a V4 proxier");
    proxier
        .sync(&c, &config(), true, ChangedServices::All, &mut probe)
        .expect("cold sync");
    let phases: Vec<Phase> = probe.0.iter().map(|(_, p)| *p).collect();
    use Phase::*;
    assert_eq!(
        phases,
        [
            State,
            Build,
            Conntrack,
            Plan,
            Commit,
            StateUpdate,
            Commit,
            Cleanup,
            Free,
            Conntrack,
            Done
        ]
    );
    assert!(probe.0.iter().all(|(f, _)| *f == Family::V4));
}

mod property {
    use proptest::prelude::*;

    use super::*;
    use crate::proxier::testkit::service;
    use dataplane::tracker::{Kind, Tracker};

    #[derive(Clone, Debug)]
    enum Step {
        /// Service `svc{id}` with this many endpoints (created or changed).
        Set {
            id: u8,
            endpoints: u8,
            dual: bool,
        },
        Delete {
            id: u8,
        },
        /// The next sync of IPv4 fails in the kernel.
        BreakV4,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (1..10u8, 1..24u8, any::<bool>())
                .prop_map(|(id, endpoints, dual)| Step::Set { id, endpoints, dual }),
            2 => (1..10u8).prop_map(|id| Step::Delete { id }),
            1 => Just(Step::BreakV4),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Partial syncs of any sequence of changes, with failures among them, are accepted
        /// by the fake kernel (no dangling reference, no deletion of what is in use, no
        /// element clash) and leave the kernel where a full sync finds nothing to do.
        #[test]
        fn partial_syncs_on_the_fake_kernel_converge(steps in prop::collection::vec(step(), 1..16)) {
            let fake = FakeKernel::new();
            let mut syncer = fake_syncer(&fake);
            let mut tracker = Tracker::new(testkit::NODE, "");
            for i in 1..=3 {
                testkit::apply(&mut tracker, &service(i, 2, true));
            }
            tracker.take_changes();
            syncer.sync(tracker.cluster(), &config(), true).expect("cold sync");
            for step in steps {
                let mut broken = false;
                match step {
                    Step::Set { id, endpoints, dual } => {
                        // A single-stack Service loses its IPv6 slice.
                        tracker.delete(
                            Kind::EndpointSlice,
                            &ObjectName::new("ns", &format!("svc{id}-ipv6")),
                        );
                        testkit::apply(&mut tracker, &service(id, endpoints, dual));
                    }
                    Step::Delete { id } => {
                        tracker.delete(Kind::Service, &ObjectName::new("ns", &format!("svc{id}")));
                    }
                    Step::BreakV4 => {
                        fake.break_family(Family::V4, Some(libc::EIO));
                        broken = true;
                    }
                }
                let changes = tracker.take_changes();
                let changed = if changes.all {
                    ChangedServices::All
                } else {
                    ChangedServices::Services(&changes.services)
                };
                let all = Family::ALL.iter().map(|f| (*f, false)).collect();
                let results = syncer.sync_families(tracker.cluster(), &config(), &all, changed);
                for (family, result) in results {
                    // (A sync with nothing to send does not reach the broken kernel.)
                    let may_fail = broken && family == Family::V4;
                    prop_assert!(result.is_ok() || may_fail, "{:?}: {:?}", family, result.err());
                }
                fake.break_family(Family::V4, None);
            }
            for record in fake.transactions() {
                prop_assert!(
                    record.refused.is_none() || record.refused == Some(libc::EIO),
                    "refused: {}", dataplane::nft::render::transaction_text(&record.tx)
                );
            }
            for (family, report) in syncer.sync(tracker.cluster(), &config(), true).expect("a full sync") {
                prop_assert_eq!(report.ops, 0, "{:?}: a full sync still finds work", family);
            }
        }
    }
}

/// A cold start large enough to be committed in parts (`split_new_chains`): each part is
/// accepted on its own, in order (no part refers to what a later one creates).
#[test]
fn a_cold_start_in_parts_is_accepted_part_by_part() {
    let mut tracker = dataplane::tracker::Tracker::new(testkit::NODE, "");
    for i in 1..=5500u16 {
        testkit::apply(&mut tracker, &testkit::numbered_service(i, 20));
    }
    let fake = FakeKernel::new();
    let mut syncer = fake_syncer(&fake);
    syncer
        .sync(tracker.cluster(), &config(), true)
        .expect("cold sync");
    let parts = fake
        .transactions()
        .iter()
        .filter(|r| r.tx.family == Family::V4)
        .count();
    assert!(parts >= 3, "{parts} transactions");
    assert!(fake.transactions().iter().all(|r| r.refused.is_none()));
    assert_nothing_to_do(&mut syncer, tracker.cluster());
}
