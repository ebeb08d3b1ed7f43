//! The sync loop: turns tracked changes into kernel syncs, at most one per `minSyncPeriod`,
//! retrying after `syncPeriod` when a sync fails (with a full sync), and re-reading the kernel
//! state periodically and whenever someone else touches nftproxy's tables.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use dataplane::build::BuildConfig;
use dataplane::model::Cluster;
use dataplane::ruleset::Family;
use dataplane::tracker::Tracker;

use crate::config::Settings;
use crate::http::health::{HealthState, node_eligible};
use crate::node_wait::{Gate, NodeWait};
use crate::sync::{Changed, FamilyReport, Syncer};

/// How often a full sync (read back, repair drift) runs when nothing asks for one sooner. Like
/// kube-proxy's nftables mode: full syncs cost O(cluster), so they are rare.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Why the sync loop should wake up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// The tracker may hold changes.
    Changed,
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
        let _ = self.wake.send(Wake::Changed);
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
    ) -> Cluster {
        loop {
            let (gate, needs) = self.with_tracker(|t| {
                let gate = node_wait.gate(t, Instant::now());
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
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// One sync attempt, as the observers see it.
pub struct SyncRun<'a> {
    pub full: bool,
    pub elapsed: Duration,
    /// The cluster and configuration the sync programmed.
    pub cluster: &'a Cluster,
    pub config: &'a BuildConfig,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of the slice changes it carried.
    pub trigger_times: &'a [(Family, String)],
    /// Per family; on failure the error and the family that failed (if known).
    pub result: &'a Result<BTreeMap<Family, FamilyReport>, (Option<Family>, String)>,
}

/// Called after every sync attempt (metrics, health).
pub trait Observer {
    fn synced(&mut self, run: &SyncRun<'_>);
}

impl Observer for () {
    fn synced(&mut self, _: &SyncRun<'_>) {}
}

/// Runs until every sender of `rx` is gone. The first sync waits as `node_wait` says.
pub fn run(
    shared: &Shared,
    rx: Receiver<Wake>,
    settings: &Settings,
    syncer: &mut Syncer,
    observer: &mut dyn Observer,
    mut node_wait: NodeWait,
) {
    let mut config = settings.build.clone();
    // The first sync reads the kernel back, adopting the rules a previous run left.
    let mut need_full = true;
    let mut failed = false;
    let mut last_end: Option<Instant> = None;
    let mut next_full = Instant::now() + FULL_SYNC_PERIOD;
    let mut retry_at = Instant::now();
    let mut addresses_changed = false;
    let mut gate_until: Option<Instant> = None;
    loop {
        let mut deadline = if failed { retry_at } else { next_full };
        if let Some(t) = gate_until {
            deadline = deadline.min(t);
        }
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Wake::Changed) => {}
            Ok(Wake::Drift) => need_full = true,
            Ok(Wake::Addresses) => addresses_changed = true,
            Err(RecvTimeoutError::Timeout) => need_full = true,
            Err(RecvTimeoutError::Disconnected) => return,
        }
        if let Some(end) = last_end {
            std::thread::sleep(settings.min_sync_period.saturating_sub(end.elapsed()));
        }
        while let Ok(w) = rx.try_recv() {
            need_full |= w == Wake::Drift;
            addresses_changed |= w == Wake::Addresses;
        }
        let (gate, needs_stand_in) = shared.with_tracker(|t| {
            let gate = node_wait.gate(t, Instant::now());
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
        let snapshot = shared.with_tracker(|t| {
            let changes = t.take_changes();
            let worth_it = !changes.is_empty() || need_full || failed || addresses_changed;
            worth_it.then(|| (t.cluster().clone(), changes))
        });
        let Some((mut cluster, changes)) = snapshot else {
            continue;
        };
        node_wait.complete(&mut cluster);
        let trigger_times = changes.trigger_times;
        let full = need_full || failed;
        // Addresses are re-read when rtnetlink says they changed, and on full syncs (which
        // also covers a host where the address watch could not be opened).
        if full || addresses_changed {
            config.local_addresses = crate::addresses::local_addresses();
        }
        addresses_changed = false;
        let changed = if changes.all {
            Changed::All
        } else {
            Changed::Services(&changes.services)
        };
        let start = Instant::now();
        let result = syncer
            .sync_changed(&cluster, &config, full, changed)
            .map_err(|e| (syncer.failed_family(), e.to_string()));
        let elapsed = start.elapsed();
        match &result {
            Ok(_) => {
                failed = false;
                need_full = false;
                if full {
                    next_full = Instant::now() + FULL_SYNC_PERIOD;
                }
            }
            Err((_, e)) => {
                tracing::error!(error = %e, retry_in = ?settings.sync_period, "sync failed; the previous rules stay in place");
                failed = true;
                retry_at = Instant::now() + settings.sync_period;
            }
        }
        observer.synced(&SyncRun {
            full,
            elapsed,
            cluster: &cluster,
            config: &config,
            trigger_times: &trigger_times,
            result: &result,
        });
        let large = full
            || result
                .as_ref()
                .is_ok_and(|r| r.values().any(|f| f.bytes > LARGE_SYNC_BYTES));
        drop((cluster, result));
        if large {
            crate::memory::release_freed();
        }
        last_end = Some(Instant::now());
    }
}

/// A sync that sent more than this is followed by handing freed heap back to the kernel (its
/// transaction and encoded batch are gone).
const LARGE_SYNC_BYTES: usize = 1 << 20;
