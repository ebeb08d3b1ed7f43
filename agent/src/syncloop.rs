//! The sync loop: turns tracked changes into kernel syncs, paced like kube-proxy's
//! `BoundedFrequencyRunner` (a burst of two, then at most one per `minSyncPeriod`), syncing each
//! IP family by its own proxier, retrying a failed family in full with exponential backoff (up
//! to `syncPeriod`), and re-reading the kernel state periodically and whenever someone else
//! touches nftproxy's tables. Time comes from a [`Clock`], so that tests drive the loop with a
//! manual one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::BuildConfig;
use dataplane::nft::ruleset::Family;
use dataplane::tracker::Tracker;

use crate::addresses::LocalAddresses;
use crate::backoff::Backoff;
use crate::clock::Clock;
use crate::config::Settings;
use crate::http::health::{HealthState, node_eligible};
use crate::node_wait::{Gate, NodeWait};
use crate::proxier::{ChangedServices, FamilyReport, SyncError, Syncer};
use crate::quarantine::{self, Moves, Quarantine};
use crate::ratelimit::Bucket;

/// How often a full sync (read back, repair drift) runs when nothing asks for one sooner. Like
/// kube-proxy's nftables mode: full syncs cost O(cluster), so they are rare.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Why the sync loop should wake up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// The tracker may hold changes.
    ChangedServices,
    /// The kernel state may differ from what we committed: re-read it.
    Drift,
    /// This host's addresses changed (NodePort addresses may differ).
    Addresses,
}

/// State shared between the sources (watchers, file) and the sync loop.
pub struct Shared {
    tracker: Mutex<Tracker>,
    wake: Sender<Wake>,
    /// Queued and completed updates, node eligibility (`/healthz`, `/livez`).
    health: Arc<HealthState>,
    /// The first sync has started: from then on changes count as queued updates.
    initialised: AtomicBool,
    /// This host's addresses, kept current by the address watcher.
    addresses: LocalAddresses,
}

impl Shared {
    pub fn new(tracker: Tracker) -> (Shared, Receiver<Wake>) {
        let (wake, rx) = channel();
        (
            Shared {
                tracker: Mutex::new(tracker),
                wake,
                health: Arc::new(HealthState::new()),
                initialised: AtomicBool::new(false),
                addresses: LocalAddresses::default(),
            },
            rx,
        )
    }

    fn lock(&self) -> MutexGuard<'_, Tracker> {
        // A panic while holding the lock cannot leave the tracker half-updated in a way that
        // matters more than stopping would: keep going with what it holds.
        self.tracker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn with_tracker<R>(&self, f: impl FnOnce(&mut Tracker) -> R) -> R {
        f(&mut self.lock())
    }

    /// Tells the sync loop the tracker may hold changes. Once the proxy is initialised,
    /// changes that need a sync count as a queued update for the health checks (kube-proxy's
    /// `QueuedUpdate`) and the metrics. Before that they do not, as in kube-proxy, whose
    /// handlers queue nothing until its proxier is initialised: a slow initial list must not
    /// fail `/livez` and get the agent restarted, which would only start the list again.
    pub fn changed(&self) {
        let (pending, counts, eligible) =
            self.with_tracker(|t| (t.has_changes(), t.change_counts(), node_eligible(t.node())));
        self.health.set_node_eligible(eligible);
        let m = metrics::metrics();
        m.set_changes(counts);
        if pending && self.initialised.load(Ordering::Relaxed) {
            for family in Family::ALL {
                self.health.queued_update(family);
            }
            m.queued(SystemTime::now());
        }
        let _ = self.wake.send(Wake::ChangedServices);
    }

    /// This host's addresses (for the address watcher to keep current).
    pub fn local_addresses(&self) -> &LocalAddresses {
        &self.addresses
    }

    /// The proxy's health state.
    pub fn health(&self) -> &Arc<HealthState> {
        &self.health
    }

    pub fn wake(&self, why: Wake) {
        let _ = self.wake.send(why);
    }

    /// The first sync is starting: the proxy counts as initialised.
    pub fn set_initialised(&self) {
        self.initialised.store(true, Ordering::Relaxed);
    }

    /// Waits (polling) until the first sync may start, then returns the cluster to program:
    /// `run --once`'s single iteration.
    pub fn wait_first_cluster(
        &self,
        node_wait: &mut NodeWait,
        kernel_node_ips: impl FnOnce() -> Vec<std::net::IpAddr>,
        clock: &mut impl Clock,
    ) -> Cluster {
        loop {
            let now = clock.now();
            let (gate, needs) = self.with_tracker(|t| {
                let gate = node_wait.gate(t, now);
                (gate, node_wait.needs_stand_in(t))
            });
            if gate == Gate::Open {
                if needs {
                    node_wait.stand_in(kernel_node_ips);
                }
                self.set_initialised();
                let mut cluster = self.with_tracker(|t| t.cluster().clone());
                node_wait.complete(&mut cluster);
                return cluster;
            }
            clock.sleep_until(now + Duration::from_millis(50));
        }
    }
}

/// One family's part of a sync attempt.
pub struct FamilyRun {
    /// A full sync (the kernel read back first), or a partial one.
    pub full: bool,
    pub result: Result<FamilyReport, String>,
    /// Failures in a row, this one included (0 after a success).
    pub failures: u32,
    /// After a failure: when the family is tried again.
    pub retry_in: Option<Duration>,
}

/// One sync attempt, as the observers see it.
pub struct SyncRun<'a> {
    /// When the sync started (by the loop's clock).
    pub started: Instant,
    pub elapsed: Duration,
    /// The cluster and configuration the sync programmed.
    pub cluster: &'a Cluster,
    pub config: &'a BuildConfig,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of the slice changes it carried.
    pub trigger_times: &'a [(Family, SystemTime)],
    /// The families synced (a family waiting to retry after a failure is left out).
    pub families: &'a BTreeMap<Family, FamilyRun>,
    /// Services kept out of the rules because the kernel refused them.
    pub quarantined: usize,
}

/// Called after every sync attempt (metrics, health).
pub trait Observer {
    fn synced(&mut self, run: &SyncRun<'_>);
}

impl Observer for () {
    fn synced(&mut self, _: &SyncRun<'_>) {}
}

/// What the loop knows of one family between syncs: its schedule. (What the family knows of
/// the kernel is its proxier's.)
struct FamilyState {
    /// The next sync of this family reads the kernel back first.
    need_full: bool,
    backoff: Backoff,
    /// While failing: not synced again before this time, whatever changes.
    retry_at: Option<Instant>,
}

impl FamilyState {
    fn new(settings: &Settings) -> FamilyState {
        // The first retry soon (a transient error), then backing off to syncPeriod, which
        // is when kube-proxy retries.
        let base = settings.min_sync_period.max(Duration::from_millis(500));
        FamilyState {
            need_full: true,
            backoff: Backoff::new(base, settings.sync_period),
            retry_at: None,
        }
    }

    fn waiting(&self, now: Instant) -> bool {
        self.retry_at.is_some_and(|t| t > now)
    }

    /// Records the outcome of a sync (`full` or not): after a failure the family is synced
    /// in full next, after a backoff delay if `back_off`, else at once.
    fn record(
        &mut self,
        family: Family,
        full: bool,
        result: Result<FamilyReport, SyncError>,
        back_off: bool,
        now: Instant,
    ) -> FamilyRun {
        let (result, retry_in) = match result {
            Ok(report) => {
                self.backoff.succeeded();
                self.need_full = false;
                self.retry_at = None;
                (Ok(report), None)
            }
            Err(e) => {
                let delay = if back_off {
                    self.backoff.failed()
                } else {
                    Duration::ZERO
                };
                self.need_full = true;
                self.retry_at = Some(now + delay);
                tracing::error!(family = family.k8s_name(), error = %e, failures = self.backoff.failures(), retry_in = ?delay, "sync failed; the previous rules stay in place");
                (Err(e.to_string()), Some(delay))
            }
        };
        FamilyRun {
            full,
            result,
            failures: self.backoff.failures(),
            retry_in,
        }
    }
}

/// After a failed sync whose error names the refused operation: sets the Services it belongs
/// to aside (adding them to `moved`), unless they are too many.
fn set_aside(
    quarantine: &mut Quarantine,
    moved: &mut BTreeSet<ObjectName>,
    error: &SyncError,
    cluster: &Cluster,
    now: Instant,
) {
    let Some(op) = error.refused_op() else {
        return;
    };
    let suspects = quarantine::suspects(op, cluster);
    let room = quarantine.len() + suspects.len() <= MAX_QUARANTINED;
    if !room {
        tracing::warn!(
            suspects = suspects.len(),
            quarantined = quarantine.len(),
            "a refused operation names too many Services to set them aside; retrying with backoff"
        );
    }
    if !suspects.is_empty() && room {
        let moves = quarantine.refused(&suspects, now);
        report_moves(&moves, &error.to_string());
        moved.extend(moves.quarantined);
    }
}

/// kube-proxy's `BoundedFrequencyRunner` allows this many syncs in a row before holding them
/// to one per `minSyncPeriod`: a change after a quiet spell is applied at once, and so is a
/// second one right after it.
pub const BURST_SYNCS: u32 = 2;

/// When syncs may start: a token bucket of [`BURST_SYNCS`] tokens refilled at one per
/// `minSyncPeriod` (none with a zero `minSyncPeriod`).
struct Pacer(Option<Bucket>);

impl Pacer {
    fn new(min_sync_period: Duration, now: Instant) -> Pacer {
        let qps = 1.0 / min_sync_period.as_secs_f64();
        Pacer((qps.is_finite() && qps > 0.0).then(|| Bucket::new(qps as f32, BURST_SYNCS, now)))
    }

    /// When the next sync may start.
    fn next(&mut self, now: Instant) -> Instant {
        now + self.0.as_mut().map_or(Duration::ZERO, |b| b.wait(now))
    }

    fn started(&mut self, now: Instant) {
        if let Some(b) = &mut self.0 {
            b.take(now);
        }
    }
}

/// `run --once`: waits until the first sync may start (the initial lists, the Node), then
/// syncs every family in full, once; the first failure is returned.
pub fn once(
    shared: &Shared,
    settings: &Settings,
    syncer: &mut Syncer,
    mut node_wait: NodeWait,
    clock: &mut impl Clock,
) -> Result<(), SyncError> {
    let cluster =
        shared.wait_first_cluster(&mut node_wait, || syncer.programmed_node_port_ips(), clock);
    for conflict in dataplane::conflicts::conflicts(&cluster.services) {
        tracing::warn!("frontend conflict: {conflict}");
    }
    let mut config = settings.build.clone();
    config.local_addresses = crate::addresses::local_addresses();
    syncer.sync(&cluster, &config, true)?;
    Ok(())
}

/// Runs until every sender of `rx` is gone. The first sync waits as `node_wait` says. Each
/// family syncs on its own: a failing family is retried with backoff (and then in full) while
/// the other keeps following changes.
pub fn run(
    shared: &Shared,
    rx: Receiver<Wake>,
    settings: &Settings,
    syncer: &mut Syncer,
    observer: &mut dyn Observer,
    mut node_wait: NodeWait,
    clock: &mut impl Clock,
) {
    if crate::testhooks::panic_in("sync") {
        panic!("NFTPROXY_TEST_PANIC=sync (a test hook)");
    }
    let mut config = settings.build.clone();
    // The first sync reads the kernel back, adopting the rules a previous run left.
    let mut families: BTreeMap<Family, FamilyState> = syncer
        .families()
        .map(|f| (f, FamilyState::new(settings)))
        .collect();
    let mut pacer = Pacer::new(settings.min_sync_period, clock.now());
    let mut next_full = clock.now() + FULL_SYNC_PERIOD;
    let mut addresses_changed = false;
    let mut gate_until: Option<Instant> = None;
    let mut quarantine = Quarantine::new(settings.sync_period, 20 * settings.sync_period);
    // Services put into or out of quarantine, to re-plan in every family at the next sync.
    let mut moved: BTreeSet<ObjectName> = BTreeSet::new();
    loop {
        let mut deadline = next_full;
        let soon = (!moved.is_empty()).then(|| clock.now());
        for t in families
            .values()
            .filter_map(|f| f.retry_at)
            .chain(gate_until)
            .chain(quarantine.next_release())
            .chain(soon)
        {
            deadline = deadline.min(t);
        }
        let mut drift = false;
        match clock.recv_until(&rx, deadline) {
            Ok(Wake::ChangedServices) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Wake::Drift) => drift = true,
            Ok(Wake::Addresses) => addresses_changed = true,
            Err(RecvTimeoutError::Disconnected) => return,
        }
        // Changes that arrive meanwhile are taken by the same sync.
        let start_at = pacer.next(clock.now());
        clock.sleep_until(start_at);
        while let Ok(w) = rx.try_recv() {
            drift |= w == Wake::Drift;
            addresses_changed |= w == Wake::Addresses;
        }
        let now = clock.now();
        if drift || now >= next_full {
            for f in families.values_mut() {
                f.need_full = true;
            }
        }
        let (gate, needs_stand_in) = shared.with_tracker(|t| {
            let gate = node_wait.gate(t, now);
            (gate, node_wait.needs_stand_in(t))
        });
        gate_until = match gate {
            Gate::Until(t) => Some(t),
            _ => None,
        };
        if gate != Gate::Open {
            continue;
        }
        if needs_stand_in {
            node_wait.stand_in(|| syncer.programmed_node_port_ips());
        }
        shared.set_initialised();
        // A family waiting to retry is left alone: its next sync rebuilds it from the cluster
        // as it is then, so it needs none of the changes taken now.
        let ready: Vec<Family> = families
            .iter()
            .filter(|(_, f)| !f.waiting(now))
            .map(|(family, _)| *family)
            .collect();
        if ready.is_empty() {
            continue;
        }
        let any_full = ready.iter().any(|f| families[f].need_full);
        for name in quarantine.release_due(now) {
            tracing::info!(service = %name, "trying a quarantined Service again");
            moved.insert(name);
        }
        let snapshot = shared.with_tracker(|t| {
            let changes = t.take_changes();
            let worth_it =
                !changes.is_empty() || any_full || addresses_changed || !moved.is_empty();
            worth_it.then(|| (t.cluster().clone(), changes))
        });
        let Some((mut cluster, mut changes)) = snapshot else {
            continue;
        };
        pacer.started(now);
        node_wait.complete(&mut cluster);
        // A Service going into or out of quarantine may have won or lost frontends to others:
        // they are re-planned too.
        let neighbours: BTreeSet<ObjectName> = moved
            .iter()
            .filter_map(|name| cluster.services.get(name))
            .flat_map(|svc| dataplane::conflicts::neighbours(&cluster.services, svc))
            .map(|s| s.name.clone())
            .collect();
        quarantine.apply(&mut cluster);
        changes.services.append(&mut moved);
        changes.services.extend(neighbours);
        let trigger_times = changes.trigger_times;
        // Addresses are taken from the watcher's table when rtnetlink says they changed, and
        // on full syncs (re-read from the kernel where the address watch could not be opened).
        if any_full || addresses_changed {
            config.local_addresses = shared.addresses.current();
        }
        addresses_changed = false;
        let changed = if changes.all {
            ChangedServices::All
        } else {
            ChangedServices::Services(&changes.services)
        };
        let plan: BTreeMap<Family, bool> =
            ready.iter().map(|f| (*f, families[f].need_full)).collect();
        let start = Instant::now();
        let results = syncer.sync_families(&cluster, &config, &plan, changed);
        let elapsed = start.elapsed();
        let mut runs = BTreeMap::new();
        for (family, result) in results {
            if let Err(e) = &result {
                set_aside(&mut quarantine, &mut moved, e, &cluster, clock.now());
            }
            let state = families.get_mut(&family).expect("every family has a state");
            // With the refused Services set aside, the rest is synced at once.
            let run = state.record(family, plan[&family], result, moved.is_empty(), clock.now());
            runs.insert(family, run);
        }
        let all_ok = runs.values().all(|r| r.result.is_ok());
        if plan.values().all(|full| *full) && all_ok {
            next_full = clock.now() + FULL_SYNC_PERIOD;
        }
        if all_ok && !quarantine.is_empty() {
            let moves = quarantine.synced(clock.now());
            report_moves(&moves, "");
            moved.extend(moves.released);
        }
        observer.synced(&SyncRun {
            started: now,
            elapsed,
            cluster: &cluster,
            config: &config,
            trigger_times: &trigger_times,
            families: &runs,
            quarantined: quarantine.len(),
        });
        let large = runs
            .values()
            .any(|r| r.full || r.result.as_ref().is_ok_and(|f| f.bytes > LARGE_SYNC_BYTES));
        drop((cluster, runs));
        if large {
            crate::memory::release_freed();
        }
    }
}

/// At most this many Services are set aside at once: a refusal that keeps naming new Services
/// is not theirs (a full set, a kernel limit), and quarantining more would only take traffic
/// away; the family then retries with backoff.
const MAX_QUARANTINED: usize = 256;

/// Logs Services put into or let out of quarantine.
fn report_moves(moves: &Moves, error: &str) {
    for name in &moves.quarantined {
        tracing::warn!(service = %name, %error, "quarantined Service: the kernel refused its rules; every other Service is synced without it, and it is tried again later");
    }
    for name in &moves.released {
        tracing::info!(service = %name, "Service let out of quarantine");
    }
}

/// A sync that sent more than this is followed by handing freed heap back to the kernel (its
/// transaction and encoded batch are gone).
const LARGE_SYNC_BYTES: usize = 1 << 20;

#[cfg(test)]
#[path = "syncloop_tests.rs"]
mod tests;
