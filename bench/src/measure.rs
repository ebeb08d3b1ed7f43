//! The measurements: syncs through the agent's `Syncer`, the same syncs timed phase by phase
//! through the proxiers' probe, the kube-proxy-shaped `nft -f` baseline, the real agent process, first-packet latency.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::BuildConfig;
use dataplane::nft::ruleset::Family;
use nftproxy::proxier::{ChangedServices, Phase, Probe, Syncer};
use serde::Serialize;

use crate::drift::{self, DriftMonitor};
use crate::heap;
use crate::netns::{self, Netns};
use crate::synth::{self, Spec};

mod latency;
mod phased;
mod processes;

pub use self::latency::*;
pub use self::phased::*;
pub use self::processes::*;

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn tv(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
}

/// User and system CPU time of the bench process: the syncing thread and the thread that
/// encodes the next part of a split transaction meanwhile (nothing else runs during a sync).
pub fn own_cpu() -> (Duration, Duration) {
    // SAFETY: getrusage fills a zeroed, locally owned struct.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

/// A CPU stopwatch: (wall, user, sys) since `start`.
struct Stopwatch {
    wall: Instant,
    user: Duration,
    sys: Duration,
}

impl Stopwatch {
    fn start() -> Stopwatch {
        let (user, sys) = own_cpu();
        Stopwatch {
            wall: Instant::now(),
            user,
            sys,
        }
    }

    fn stop(&self) -> (f64, f64, f64) {
        let wall = self.wall.elapsed();
        let (user, sys) = own_cpu();
        (ms(wall), ms(user - self.user), ms(sys - self.sys))
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The agent's build configuration, resolved from the same file the child agent reads.
pub fn build_config() -> Result<BuildConfig> {
    let file = nftproxy::config::KubeProxyConfiguration::parse(&synth::kube_proxy_config())
        .map_err(anyhow::Error::msg)?;
    let settings = nftproxy::config::Settings::resolve(&file, &Default::default())?;
    Ok(settings.build)
}

// ---------------------------------------------------------------------------------------------
// Syncs through the agent's Syncer

/// One sync through `Syncer::sync`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SyncRun {
    pub wall_ms: f64,
    /// CPU of the syncing thread (getrusage RUSAGE_THREAD); nf_tables processes the batch in
    /// the sender's context, so `sys_ms` is mostly the kernel's commit work.
    pub user_ms: f64,
    pub sys_ms: f64,
    pub v4_ops: usize,
    pub v4_messages: usize,
    pub v4_bytes: usize,
    pub messages: usize,
    pub bytes: usize,
}

impl SyncRun {
    fn median(runs: &[SyncRun]) -> SyncRun {
        let f = |g: fn(&SyncRun) -> f64| median(runs.iter().map(g).collect());
        let u =
            |g: fn(&SyncRun) -> usize| median(runs.iter().map(|r| g(r) as f64).collect()) as usize;
        SyncRun {
            wall_ms: f(|r| r.wall_ms),
            user_ms: f(|r| r.user_ms),
            sys_ms: f(|r| r.sys_ms),
            v4_ops: u(|r| r.v4_ops),
            v4_messages: u(|r| r.v4_messages),
            v4_bytes: u(|r| r.v4_bytes),
            messages: u(|r| r.messages),
            bytes: u(|r| r.bytes),
        }
    }
}

/// The model changes of the partial-sync measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartialOp {
    AddEndpoint,
    RemoveEndpoint,
    AddService,
    DeleteService,
    NoChange,
}

impl PartialOp {
    pub const ALL: [PartialOp; 5] = [
        PartialOp::AddEndpoint,
        PartialOp::RemoveEndpoint,
        PartialOp::AddService,
        PartialOp::DeleteService,
        PartialOp::NoChange,
    ];

    /// The two endpoint changes, measured in more ways than the other operations.
    pub const ENDPOINT_CHANGES: [PartialOp; 2] =
        [PartialOp::AddEndpoint, PartialOp::RemoveEndpoint];

    pub fn name(self) -> &'static str {
        match self {
            PartialOp::AddEndpoint => "endpoint added",
            PartialOp::RemoveEndpoint => "endpoint removed",
            PartialOp::AddService => "Service added",
            PartialOp::DeleteService => "Service deleted",
            PartialOp::NoChange => "no change",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            PartialOp::AddEndpoint => "endpoint_added",
            PartialOp::RemoveEndpoint => "endpoint_removed",
            PartialOp::AddService => "service_added",
            PartialOp::DeleteService => "service_deleted",
            PartialOp::NoChange => "no_change",
        }
    }

    /// Applies the change for repetition `rep` to a cluster of `n` Services; returns the
    /// Services it changed (what the agent's change tracker would report).
    fn apply(
        self,
        cluster: &mut Cluster,
        n: usize,
        k: usize,
        rep: usize,
    ) -> Result<BTreeSet<ObjectName>> {
        // A ClusterIP Service from the middle of the cluster on, a different one per repetition
        // (as long as there are enough).
        let target = Spec::of(((n / 2) / 10 * 10 + rep * 10) % (n / 10 * 10).max(10), k);
        let extra_ep = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + rep as u32);
        let extra_svc = synth::extra_spec(n, rep, k);
        let changed = match self {
            PartialOp::AddEndpoint => {
                synth::add_endpoint(cluster, &target, extra_ep)?;
                Some(target.object_name())
            }
            PartialOp::RemoveEndpoint => {
                synth::remove_endpoint(cluster, &target, extra_ep)?;
                Some(target.object_name())
            }
            PartialOp::AddService => {
                let mut objects = vec![extra_svc.service()];
                objects.extend(extra_svc.slices());
                synth::add_to_cluster(cluster, &objects)?;
                Some(extra_svc.object_name())
            }
            PartialOp::DeleteService => {
                synth::remove_service(cluster, &extra_svc.object_name());
                Some(extra_svc.object_name())
            }
            PartialOp::NoChange => None,
        };
        Ok(changed.into_iter().collect())
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SyncerResult {
    pub cold: SyncRun,
    /// Median over the repetitions, by operation key.
    pub partial: BTreeMap<String, SyncRun>,
    pub partial_runs: BTreeMap<String, Vec<SyncRun>>,
    /// Endpoint changes synced right after the CPU caches were emptied: median, by key.
    pub cold_cache: BTreeMap<String, SyncRun>,
    pub cold_cache_runs: BTreeMap<String, Vec<SyncRun>>,
}

/// Rounds of partial syncs run, and not recorded, before the measured ones: the first change
/// after a cold sync also pays for first touches of memory (page faults, allocator growth)
/// that no later change sees.
const WARM_UP_ROUNDS: usize = 1;

/// Cold full sync, then partial syncs, through the agent's `Syncer` in a fresh namespace.
pub fn syncer_bench(
    label: &str,
    cluster: &Cluster,
    config: &BuildConfig,
    n: usize,
    k: usize,
    reps: usize,
) -> Result<SyncerResult> {
    let ns = Netns::create(label)?;
    ns.run_in(|| {
        let mut config = config.clone();
        config.local_addresses = nftproxy::addresses::local_addresses();
        let mut cluster = cluster.clone();
        let (mut syncer, _monitor) = drift::daemon_syncer()?;
        let mut out = SyncerResult {
            cold: syncer_run(&mut syncer, &cluster, &config, true, ChangedServices::All)?,
            ..SyncerResult::default()
        };
        for rep in 0..WARM_UP_ROUNDS + reps {
            for op in PartialOp::ALL {
                let changed = op.apply(&mut cluster, n, k, rep)?;
                let run = partial_run(&mut syncer, &cluster, &config, &changed)
                    .with_context(|| format!("partial sync ({})", op.name()))?;
                if rep >= WARM_UP_ROUNDS {
                    record(&mut out.partial_runs, op, run);
                }
            }
        }
        // The same endpoint changes (on other Services) with the CPU caches emptied first: what
        // a sync costs when everything else ran since the last one.
        let mut evictor = CacheEvictor::new();
        for rep in WARM_UP_ROUNDS + reps..WARM_UP_ROUNDS + 2 * reps {
            for op in PartialOp::ENDPOINT_CHANGES {
                let changed = op.apply(&mut cluster, n, k, rep)?;
                evictor.evict();
                let run = partial_run(&mut syncer, &cluster, &config, &changed)
                    .with_context(|| format!("partial sync ({}, cold caches)", op.name()))?;
                record(&mut out.cold_cache_runs, op, run);
            }
        }
        out.partial = medians(&out.partial_runs);
        out.cold_cache = medians(&out.cold_cache_runs);
        Ok(out)
    })
}

/// Syncs the Services a partial change reported.
fn partial_run(
    syncer: &mut Syncer,
    cluster: &Cluster,
    config: &BuildConfig,
    changed: &BTreeSet<ObjectName>,
) -> Result<SyncRun> {
    syncer_run(
        syncer,
        cluster,
        config,
        false,
        ChangedServices::Services(changed),
    )
}

fn record(runs: &mut BTreeMap<String, Vec<SyncRun>>, op: PartialOp, run: SyncRun) {
    runs.entry(op.key().to_string()).or_default().push(run);
}

/// The median of each operation's runs.
fn medians(runs: &BTreeMap<String, Vec<SyncRun>>) -> BTreeMap<String, SyncRun> {
    runs.iter()
        .map(|(key, runs)| (key.clone(), SyncRun::median(runs)))
        .collect()
}

/// One cluster of [`side_by_side_bench`]: its size and model.
pub struct SideBySideCluster<'a> {
    pub n: usize,
    pub cluster: &'a Cluster,
}

/// Endpoint changes on two clusters synced alternately, each by its own `Syncer` in its own
/// namespace: both sizes see the machine in the same state. Measured one size after the other,
/// minutes apart, the same sync moved by up to ±30% between runs on this VM, which is more than
/// the difference being compared. Returns the medians by operation key, per cluster.
pub fn side_by_side_bench(
    clusters: [SideBySideCluster<'_>; 2],
    config: &BuildConfig,
    k: usize,
    reps: usize,
) -> Result<[BTreeMap<String, SyncRun>; 2]> {
    // Fields drop in order: the Syncer's sockets close before the namespace is deleted.
    struct Side {
        syncer: Syncer,
        _monitor: DriftMonitor,
        _ns: Netns,
        n: usize,
        cluster: Cluster,
        config: BuildConfig,
        runs: BTreeMap<String, Vec<SyncRun>>,
    }
    let mut sides = Vec::new();
    for c in clusters {
        let ns = Netns::create(&format!("side{}", c.n))?;
        let (syncer, monitor, config) = ns.run_in(|| {
            let mut config = config.clone();
            config.local_addresses = nftproxy::addresses::local_addresses();
            let (mut syncer, monitor) = drift::daemon_syncer()?;
            syncer.sync(c.cluster, &config, true)?;
            Ok((syncer, monitor, config))
        })?;
        sides.push(Side {
            syncer,
            _monitor: monitor,
            _ns: ns,
            n: c.n,
            cluster: c.cluster.clone(),
            config,
            runs: BTreeMap::new(),
        });
    }
    // Both change the same Services, picked as in the smaller cluster: both shapes are nested
    // (a cluster's first Services are the smaller one's), and in the realistic shape Services
    // picked by each cluster's own size differ in ports, families and endpoints, which moved
    // the ratio more than the size did.
    let pick_from = sides.iter().map(|s| s.n).min().unwrap_or_default();
    for rep in 0..WARM_UP_ROUNDS + reps {
        // Each round in the other order, so that neither size always follows the other.
        let order: [usize; 2] = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let side = &mut sides[i];
            for op in PartialOp::ENDPOINT_CHANGES {
                let changed = op.apply(&mut side.cluster, pick_from, k, rep)?;
                // The Syncer's sockets were opened in its namespace and stay there.
                let run = partial_run(&mut side.syncer, &side.cluster, &side.config, &changed)
                    .with_context(|| {
                        format!("{} Services: partial sync ({})", side.n, op.name())
                    })?;
                if rep >= WARM_UP_ROUNDS {
                    record(&mut side.runs, op, run);
                }
            }
        }
    }
    Ok([medians(&sides[0].runs), medians(&sides[1].runs)])
}

/// Empties the CPU caches (and the TLB's hold on the agent's pages) by writing a buffer twice
/// the size of a large last-level cache.
struct CacheEvictor {
    buffer: Vec<u8>,
    round: u8,
}

impl CacheEvictor {
    const BYTES: usize = 64 << 20;

    fn new() -> CacheEvictor {
        CacheEvictor {
            buffer: vec![0; Self::BYTES],
            round: 0,
        }
    }

    fn evict(&mut self) {
        self.round = self.round.wrapping_add(1);
        for line in self.buffer.chunks_mut(64) {
            line[0] = self.round;
        }
        std::hint::black_box(&self.buffer);
    }
}

fn syncer_run(
    syncer: &mut Syncer,
    cluster: &Cluster,
    config: &BuildConfig,
    full: bool,
    changed: ChangedServices<'_>,
) -> Result<SyncRun> {
    let sw = Stopwatch::start();
    let both = Family::ALL.iter().map(|f| (*f, full)).collect();
    let reports = syncer
        .sync_families(cluster, config, &both, changed)
        .into_iter()
        .map(|(family, r)| r.map(|report| (family, report)))
        .collect::<Result<BTreeMap<_, _>, _>>()?;
    let (wall_ms, user_ms, sys_ms) = sw.stop();
    let v4 = reports.get(&Family::V4).copied().unwrap_or_default();
    Ok(SyncRun {
        wall_ms,
        user_ms,
        sys_ms,
        v4_ops: v4.ops,
        v4_messages: v4.messages,
        v4_bytes: v4.bytes,
        messages: reports.values().map(|r| r.messages).sum(),
        bytes: reports.values().map(|r| r.bytes).sum(),
    })
}
