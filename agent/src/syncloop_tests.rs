//! The sync loop on the fake kernel and a manual clock: when syncs start, which families they
//! cover, and whether they are full, in simulated hours that take milliseconds.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dataplane::nft::ruleset::Family;
use dataplane::tracker::Tracker;

use super::*;
use crate::clock::TestClock;
use crate::config::Settings;
use crate::nftables::fake::FakeKernel;
use crate::node_wait::NodeWait;
use crate::proxier::Syncer;
use crate::proxier::testkit::{self, NODE, fake_syncer, service};

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// One sync as the observer saw it.
#[derive(Clone, Debug)]
struct Seen {
    at: Duration,
    /// Per family synced: (full, succeeded, drift repaired).
    families: BTreeMap<Family, (bool, bool, bool)>,
    quarantined: usize,
}

struct Recorder {
    start: Instant,
    runs: Vec<Seen>,
}

impl Observer for Recorder {
    fn synced(&mut self, run: &SyncRun<'_>) {
        let families = run
            .families
            .iter()
            .map(|(f, r)| {
                let repaired = r.result.as_ref().is_ok_and(|r| r.drift_repaired);
                (*f, (r.full, r.result.is_ok(), repaired))
            })
            .collect();
        self.runs.push(Seen {
            at: run.started - self.start,
            families,
            quarantined: run.quarantined,
        });
    }
}

struct Harness {
    shared: Arc<Shared>,
    rx: Receiver<Wake>,
    settings: Settings,
    fake: FakeKernel,
    syncer: Syncer,
    clock: TestClock,
}

impl Harness {
    /// Services `initial` (listed completely if `listed`), `minSyncPeriod` `min`, a clock
    /// ending after `end`.
    fn new(initial: &[u8], listed: bool, min: &str, end: Duration) -> Harness {
        let mut tracker = Tracker::new(NODE, "");
        testkit::begin_lists(&mut tracker);
        for i in initial {
            testkit::apply(&mut tracker, &service(*i, 1, true));
        }
        if listed {
            testkit::end_lists(&mut tracker);
        }
        let (shared, rx) = Shared::new(tracker);
        let fake = FakeKernel::new();
        let syncer = fake_syncer(&fake);
        Harness {
            shared: Arc::new(shared),
            rx,
            settings: testkit::settings(min, "30s"),
            fake,
            syncer,
            clock: TestClock::new(end),
        }
    }

    /// At `at`, `f` changes the tracker and the loop is told.
    fn at(&mut self, at: Duration, f: impl FnOnce(&mut Tracker) + Send + 'static) {
        let shared = self.shared.clone();
        self.clock.at(at, move || {
            shared.with_tracker(f);
            shared.changed();
        });
    }

    /// At `at`, Service `svc{i}` is added (or changed to `endpoints` endpoints).
    fn service_at(&mut self, at: Duration, i: u8, endpoints: u8) {
        self.at(at, move |t| testkit::apply(t, &service(i, endpoints, true)));
    }

    /// Runs the loop until the clock ends; the syncs it made.
    fn run(mut self) -> (Vec<Seen>, FakeKernel) {
        let mut recorder = Recorder {
            start: self.clock.now(),
            runs: Vec::new(),
        };
        // As the agent does once its sources are started.
        self.shared.changed();
        let node_wait = NodeWait::new(NODE, None, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        run(
            &self.shared,
            self.rx,
            &self.settings,
            &mut self.syncer,
            &mut recorder,
            node_wait,
            &mut self.clock,
        );
        (recorder.runs, self.fake)
    }
}

fn times(runs: &[Seen]) -> Vec<Duration> {
    runs.iter().map(|r| r.at).collect()
}

fn close(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) < Duration::from_millis(2)
}

/// Whether the kernel's table of `family` serves Service `svc{i}`.
fn serves(fake: &FakeKernel, family: Family, i: u8) -> bool {
    let frontend = match family {
        Family::V4 => format!("172.30.0.{i} . tcp . 80"),
        Family::V6 => format!("fd00::{i} . tcp . 80"),
    };
    fake.render(family).contains(&frontend)
}

#[test]
fn nothing_is_synced_before_the_initial_lists_are_complete() {
    let mut h = Harness::new(&[1, 2], false, "1s", secs(60.0));
    h.service_at(secs(1.0), 3, 1);
    h.at(secs(5.0), testkit::end_lists);
    let (runs, fake) = h.run();
    assert_eq!(times(&runs), [secs(5.0)], "{runs:?}");
    for family in Family::ALL {
        assert_eq!(runs[0].families[&family], (true, true, false));
        assert!((1..=3).all(|i| serves(&fake, family, i)));
    }
}

#[test]
fn a_change_after_a_quiet_spell_is_applied_at_once_and_churn_is_batched() {
    let mut h = Harness::new(&[1], true, "1s", secs(40.0));
    // An isolated change, and a second right after it (kube-proxy's burst of two).
    h.service_at(secs(10.0), 2, 1);
    h.service_at(secs(10.1), 3, 1);
    // Then a change every 100 ms: batched, one sync per second.
    for k in 0..8u8 {
        h.service_at(secs(10.2 + 0.1 * f64::from(k)), 4 + k, 1);
    }
    // Churn: an endpoint change every 50 ms for 10 s.
    for k in 0..200u32 {
        let endpoints = 1 + (k % 3) as u8;
        h.service_at(secs(20.0 + 0.05 * f64::from(k)), 1, endpoints);
    }
    let (runs, fake) = h.run();
    let t = times(&runs);
    assert!(t.len() >= 4, "{t:?}");
    assert!(close(t[0], secs(0.0)), "{t:?}");
    assert!(close(t[1], secs(10.0)), "the isolated change waited: {t:?}");
    assert!(
        close(t[2], secs(10.1)),
        "the second of the burst waited: {t:?}"
    );
    assert!(close(t[3], secs(11.0)), "{t:?}");
    let first_churn = t
        .iter()
        .position(|t| *t >= secs(20.0))
        .expect("churn synced");
    assert_eq!(
        first_churn, 4,
        "one sync took all the 100 ms changes: {t:?}"
    );
    // Churn: after its burst of two, never more than one sync per second.
    let churn = &t[first_churn..];
    // (The change at 20 s sets the one endpoint svc1 already has: nothing to sync.)
    assert!(
        close(churn[0], secs(20.05)) && close(churn[1], secs(20.1)),
        "{t:?}"
    );
    // The bucket refills from the first sync of the burst on.
    assert!(churn[2] - churn[0] >= secs(0.999), "{t:?}");
    for pair in churn[2..].windows(2) {
        assert!(pair[1] - pair[0] >= secs(0.999), "{t:?}");
    }
    assert!(churn.len() <= 2 + 10 + 1, "{t:?}");
    // Every change reached the kernel, the last one included.
    for family in Family::ALL {
        assert!((1..=11).all(|i| serves(&fake, family, i)), "{family:?}");
    }
    let last = 1 + (199 % 3) as u8;
    assert_eq!(
        fake.render(Family::V4).matches("10.1.1.").count(),
        // Each endpoint shows in an endpoint map and the hairpin set (twice there).
        3 * usize::from(last),
        "{}",
        fake.render(Family::V4)
    );
    assert!(
        runs.iter()
            .skip(1)
            .all(|r| r.families.values().all(|f| !f.0))
    );
}

#[test]
fn a_failed_family_is_retried_with_backoff_in_full_while_the_other_syncs() {
    let mut h = Harness::new(&[1], true, "1s", secs(30.0));
    let fake = h.fake.clone();
    h.clock.at(secs(4.9), move || {
        fake.break_family(Family::V4, Some(libc::EIO));
    });
    h.service_at(secs(5.0), 2, 1);
    h.service_at(secs(5.3), 3, 1);
    let fake = h.fake.clone();
    h.clock
        .at(secs(5.5), move || fake.break_family(Family::V4, None));
    let reads_before = h.fake.reads();
    let (runs, fake) = h.run();
    assert_eq!(runs.len(), 4, "{runs:?}");
    let [cold, failed, other, retry] = [&runs[0], &runs[1], &runs[2], &runs[3]];
    assert!(close(cold.at, secs(0.0)));
    assert!(close(failed.at, secs(5.0)), "{runs:?}");
    assert_eq!(failed.families[&Family::V4], (false, false, false));
    assert_eq!(failed.families[&Family::V6], (false, true, false));
    // While V4 waits to retry, V6 follows the changes alone.
    assert!(close(other.at, secs(5.3)), "{runs:?}");
    assert_eq!(other.families.keys().collect::<Vec<_>>(), [&Family::V6]);
    // The retry, after the first backoff (1 s ± 20%), is a full sync: it reads back.
    let wait = retry.at - failed.at;
    assert!(wait >= secs(0.8) && wait <= secs(1.2), "{runs:?}");
    assert_eq!(retry.families[&Family::V4], (true, true, false));
    assert_eq!(retry.families[&Family::V6], (false, true, false));
    assert_eq!(
        fake.reads(),
        reads_before + 2 + 1,
        "two cold reads, one after the failure"
    );
    for family in Family::ALL {
        assert!((1..=3).all(|i| serves(&fake, family, i)), "{family:?}");
    }
}

#[test]
fn a_family_that_keeps_failing_backs_off_to_the_sync_period() {
    let mut h = Harness::new(&[1], true, "1s", secs(200.0));
    h.fake.break_family(Family::V6, Some(libc::EIO));
    for k in 0..90u8 {
        h.service_at(secs(1.0 + 2.0 * f64::from(k)), 2 + k % 100, 1);
    }
    let (runs, fake) = h.run();
    let v4: Vec<&Seen> = runs
        .iter()
        .filter(|r| r.families.contains_key(&Family::V4))
        .collect();
    assert!(
        v4.iter().all(|r| r.families[&Family::V4].1),
        "V4 never fails"
    );
    assert!(v4.len() >= 90, "V4 followed every change: {}", v4.len());
    let v6: Vec<Duration> = runs
        .iter()
        .filter(|r| r.families.contains_key(&Family::V6))
        .map(|r| r.at)
        .collect();
    assert!(
        runs.iter()
            .filter_map(|r| r.families.get(&Family::V6))
            .all(|f| !f.1)
    );
    // 1, 2, 4, 8, 16 s, then 30 s (syncPeriod), each ± 20%, and at most a second of pacing.
    let gaps: Vec<Duration> = v6.windows(2).map(|w| w[1] - w[0]).collect();
    for (k, gap) in gaps.iter().enumerate() {
        let nominal = secs(f64::from(1u32 << k.min(5)).min(30.0));
        assert!(*gap >= nominal.mul_f64(0.8), "{k}: {gaps:?}");
        assert!(*gap <= nominal.mul_f64(1.2) + secs(1.0), "{k}: {gaps:?}");
    }
    assert!(gaps.len() >= 6 && gaps.len() <= 12, "{gaps:?}");
    assert!(serves(&fake, Family::V4, 91));
    assert_eq!(fake.render(Family::V6), "");
}

#[test]
fn drift_wakes_a_full_sync_and_full_syncs_come_hourly() {
    let mut h = Harness::new(&[1, 2], true, "1s", FULL_SYNC_PERIOD + secs(600.0));
    let tamper = |fake: &FakeKernel| {
        fake.tamper(Family::V4, |t| {
            t.as_mut()
                .unwrap()
                .sets
                .get_mut("cluster-ips")
                .unwrap()
                .elements_mut()
                .clear()
        })
    };
    let (fake, shared) = (h.fake.clone(), h.shared.clone());
    h.clock.at(secs(60.0), move || {
        tamper(&fake);
        shared.wake(Wake::Drift);
    });
    let fake = h.fake.clone();
    // Unnoticed by the monitor: the hourly full sync repairs it.
    h.clock.at(secs(120.0), move || tamper(&fake));
    let (runs, fake) = h.run();
    let t = times(&runs);
    assert_eq!(t.len(), 3, "{runs:?}");
    assert!(close(t[1], secs(60.0)), "{t:?}");
    assert_eq!(runs[1].families[&Family::V4], (true, true, true));
    assert_eq!(runs[1].families[&Family::V6], (true, true, false));
    assert!(close(t[2], secs(60.0) + FULL_SYNC_PERIOD), "{t:?}");
    assert_eq!(runs[2].families[&Family::V4], (true, true, true));
    assert!(serves(&fake, Family::V4, 1) && serves(&fake, Family::V4, 2));
}

#[test]
fn once_waits_for_the_lists_and_syncs_each_family_once() {
    let mut h = Harness::new(&[1, 2], false, "1s", secs(60.0));
    h.at(secs(2.0), testkit::end_lists);
    let node_wait = NodeWait::new(NODE, None, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    once(
        &h.shared,
        &h.settings,
        &mut h.syncer,
        node_wait,
        &mut h.clock,
    )
    .expect("once");
    assert!(h.clock.elapsed() >= secs(2.0) && h.clock.elapsed() < secs(2.1));
    let log = h.fake.transactions();
    for family in Family::ALL {
        let sent = log.iter().filter(|r| r.tx.family == family).count();
        assert_eq!(sent, 1, "{family:?}");
        assert!(serves(&h.fake, family, 1) && serves(&h.fake, family, 2));
    }
    // A failure is the result.
    let mut h = Harness::new(&[1], true, "1s", secs(60.0));
    h.fake.break_family(Family::V6, Some(libc::EIO));
    let node_wait = NodeWait::new(NODE, None, IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let err = once(
        &h.shared,
        &h.settings,
        &mut h.syncer,
        node_wait,
        &mut h.clock,
    )
    .expect_err("V6 fails");
    assert!(err.to_string().contains("Input/output error"), "{err}");
}

#[test]
fn a_service_the_kernel_refuses_is_quarantined_and_tried_again_later() {
    let mut h = Harness::new(&[1, 2, 3, 4], true, "1s", secs(120.0));
    // The kernel refuses svc3's IPv4 frontend until 10 s.
    h.fake.refuse_matching(Some("172.30.0.3 . tcp . 80"));
    let fake = h.fake.clone();
    h.clock.at(secs(10.0), move || fake.refuse_matching(None));
    h.service_at(secs(5.0), 5, 1);
    let (runs, fake) = h.run();
    // The first sync fails in IPv4; svc3 is set aside and the rest synced at once.
    assert_eq!(
        runs[0].families[&Family::V4],
        (true, false, false),
        "{runs:?}"
    );
    assert!(close(runs[1].at, secs(0.0)), "{runs:?}");
    assert_eq!(
        runs[1].families[&Family::V4],
        (true, true, false),
        "{runs:?}"
    );
    assert_eq!(runs[1].quarantined, 1);
    // Meanwhile other changes are synced, without svc3 in either family.
    let at5 = runs
        .iter()
        .find(|r| close(r.at, secs(5.0)))
        .expect("a sync at 5 s");
    assert!(
        at5.families.values().all(|f| f.1) && at5.quarantined == 1,
        "{runs:?}"
    );
    // After syncPeriod (30 s ± 20%) it is tried again, now accepted, and released.
    let back = runs
        .iter()
        .position(|r| r.quarantined == 0 && r.at > secs(1.0));
    let back = &runs[back.expect("released")];
    assert!(back.at >= secs(24.0) && back.at <= secs(37.0), "{runs:?}");
    for family in Family::ALL {
        assert!((1..=5).all(|i| serves(&fake, family, i)), "{family:?}");
    }
    assert!(
        fake.transactions()
            .iter()
            .filter(|r| r.refused.is_some())
            .all(|r| r.tx.family == Family::V4)
    );
}
