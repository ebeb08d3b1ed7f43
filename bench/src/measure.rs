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
use nftproxy::proxier::{Changed, Phase, Probe, Syncer};
use serde::Serialize;

use crate::heap;
use crate::netns::{self, Netns};
use crate::synth::{self, Spec};

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
        let mut syncer = Syncer::new().context("opening the Syncer")?;
        let mut out = SyncerResult {
            cold: syncer_run(&mut syncer, &cluster, &config, true, Changed::All)?,
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
    syncer_run(syncer, cluster, config, false, Changed::Services(changed))
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
        _ns: Netns,
        n: usize,
        cluster: Cluster,
        config: BuildConfig,
        runs: BTreeMap<String, Vec<SyncRun>>,
    }
    let mut sides = Vec::new();
    for c in clusters {
        let ns = Netns::create(&format!("side{}", c.n))?;
        let (syncer, config) = ns.run_in(|| {
            let mut config = config.clone();
            config.local_addresses = nftproxy::addresses::local_addresses();
            let mut syncer = Syncer::new().context("opening the Syncer")?;
            syncer.sync(c.cluster, &config, true)?;
            Ok((syncer, config))
        })?;
        sides.push(Side {
            syncer,
            _ns: ns,
            n: c.n,
            cluster: c.cluster.clone(),
            config,
            runs: BTreeMap::new(),
        });
    }
    for rep in 0..WARM_UP_ROUNDS + reps {
        // Each round in the other order, so that neither size always follows the other.
        let order: [usize; 2] = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let side = &mut sides[i];
            for op in PartialOp::ENDPOINT_CHANGES {
                let changed = op.apply(&mut side.cluster, side.n, k, rep)?;
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
    changed: Changed<'_>,
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

// ---------------------------------------------------------------------------------------------
// The same pipeline, phase by phase

/// Where one family's sync spends its time (wall, ms), as the agent's proxier reports its
/// phases ([`Phase`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Phases {
    /// `Desired::build` (cold) or `Desired::update` of the changed Services (partial).
    pub build_ms: f64,
    /// The current state: read back from the kernel (full syncs) or a clone of the committed
    /// state (partial syncs).
    pub state_ms: f64,
    /// `dataplane::nft::plan::plan`: the diff of the whole current and desired tables.
    pub plan_ms: f64,
    /// `Nftables::apply` of the main transaction: encoding, send, the kernel's processing and
    /// commit, the ACK.
    pub kernel_ms: f64,
    /// CPU of the apply: user (encoding the batch, reading the ACK) and system (nf_tables
    /// processing the batch and committing, in the sending thread's context).
    pub kernel_user_ms: f64,
    pub kernel_sys_ms: f64,
    /// Applying the transaction to the committed state, planning and applying the cleanup
    /// transaction (chain deletions), the UDP conntrack bookkeeping (`Frontends::of`).
    pub other_ms: f64,
    /// Parts of `other_ms`: `TableState::apply` of the transaction; `plan_cleanup` and its
    /// transaction; `Frontends::of` (UDP conntrack bookkeeping); freeing the desired table and
    /// the transactions.
    pub state_update_ms: f64,
    pub cleanup_ms: f64,
    pub frontends_ms: f64,
    pub free_ms: f64,
    pub total_ms: f64,
    pub user_ms: f64,
    pub sys_ms: f64,
    pub ops: usize,
    pub messages: usize,
    pub bytes: usize,
    /// Heap retained by the desired table, the planned transaction and the committed state
    /// after the sync; the transient peak above the level before `apply` (the encoded batch
    /// and its bookkeeping); and the peak of the whole family sync above its start. MiB.
    pub heap_table_mib: f64,
    pub heap_transaction_mib: f64,
    pub heap_state_mib: f64,
    pub heap_apply_peak_mib: f64,
    pub heap_sync_peak_mib: f64,
}

impl Phases {
    fn median(runs: &[Phases]) -> Phases {
        let f = |g: fn(&Phases) -> f64| median(runs.iter().map(g).collect());
        Phases {
            build_ms: f(|p| p.build_ms),
            state_ms: f(|p| p.state_ms),
            plan_ms: f(|p| p.plan_ms),
            kernel_ms: f(|p| p.kernel_ms),
            kernel_user_ms: f(|p| p.kernel_user_ms),
            kernel_sys_ms: f(|p| p.kernel_sys_ms),
            other_ms: f(|p| p.other_ms),
            state_update_ms: f(|p| p.state_update_ms),
            cleanup_ms: f(|p| p.cleanup_ms),
            frontends_ms: f(|p| p.frontends_ms),
            free_ms: f(|p| p.free_ms),
            total_ms: f(|p| p.total_ms),
            user_ms: f(|p| p.user_ms),
            sys_ms: f(|p| p.sys_ms),
            ops: f(|p| p.ops as f64) as usize,
            messages: f(|p| p.messages as f64) as usize,
            bytes: f(|p| p.bytes as f64) as usize,
            heap_table_mib: f(|p| p.heap_table_mib),
            heap_transaction_mib: f(|p| p.heap_transaction_mib),
            heap_state_mib: f(|p| p.heap_state_mib),
            heap_apply_peak_mib: f(|p| p.heap_apply_peak_mib),
            heap_sync_peak_mib: f(|p| p.heap_sync_peak_mib),
        }
    }
}

/// Times the phases of one family's sync as the agent's proxier reports them
/// ([`nftproxy::proxier::Probe`]): wall and CPU per phase, and the heap at the phase boundaries.
struct PhaseTimer {
    current: Option<(Phase, Instant, (Duration, Duration))>,
    wall: BTreeMap<Phase, Duration>,
    cpu: BTreeMap<Phase, (Duration, Duration)>,
    heap_start: usize,
    heap_entered: usize,
    heap_planned: usize,
    peak_before_apply: usize,
    committing: bool,
    p: Phases,
}

impl PhaseTimer {
    fn new() -> PhaseTimer {
        heap::reset_peak();
        PhaseTimer {
            current: None,
            wall: BTreeMap::new(),
            cpu: BTreeMap::new(),
            heap_start: heap::current(),
            heap_entered: 0,
            heap_planned: 0,
            peak_before_apply: 0,
            committing: false,
            p: Phases::default(),
        }
    }

    fn wall_ms(&self, phase: Phase) -> f64 {
        ms(self.wall.get(&phase).copied().unwrap_or_default())
    }
}

impl Probe for PhaseTimer {
    fn enter(&mut self, _family: Family, phase: Phase) {
        let now = Instant::now();
        let cpu = own_cpu();
        let heap_now = heap::current();
        if let Some((left, since, (user, sys))) = self.current.take() {
            *self.wall.entry(left).or_default() += now - since;
            let c = self.cpu.entry(left).or_default();
            c.0 += cpu.0 - user;
            c.1 += cpu.1 - sys;
            match left {
                Phase::Build => {
                    self.p.heap_table_mib = heap::mib(heap_now.saturating_sub(self.heap_entered))
                }
                Phase::Plan => {
                    self.heap_planned = heap_now;
                    self.p.heap_transaction_mib =
                        heap::mib(heap_now.saturating_sub(self.heap_entered));
                }
                _ => {}
            }
        }
        match phase {
            Phase::Commit if !self.committing => {
                // The transient peak of the commit (the encoded batch and its bookkeeping).
                self.committing = true;
                self.peak_before_apply = heap::peak();
                heap::reset_peak();
            }
            Phase::Cleanup => {
                self.p.heap_apply_peak_mib =
                    heap::mib(heap::peak().saturating_sub(self.heap_planned));
                self.peak_before_apply = self.peak_before_apply.max(heap::peak());
            }
            // After the commit: what the sync keeps (meaningful for the cold sync).
            Phase::Conntrack if self.committing => {
                self.p.heap_state_mib = heap::mib(heap_now.saturating_sub(self.heap_start));
            }
            Phase::Done => {
                let peak = self.peak_before_apply.max(heap::peak());
                self.p.heap_sync_peak_mib = heap::mib(peak.saturating_sub(self.heap_start));
            }
            _ => {}
        }
        self.heap_entered = heap_now;
        self.current = (phase != Phase::Done).then_some((phase, now, cpu));
    }
}

/// Syncs of the agent's own proxiers (`Syncer::proxier`), each family timed phase by phase.
struct Phased {
    syncer: Syncer,
}

impl Phased {
    fn sync_family(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        family: Family,
        full: bool,
        changed: Changed<'_>,
    ) -> Result<Phases> {
        let proxier = self.syncer.proxier(family).context("no proxier")?;
        let sw = Stopwatch::start();
        let mut timer = PhaseTimer::new();
        let report = proxier.sync(cluster, config, full, changed, &mut timer)?;
        let (total, user, sys) = sw.stop();
        let t = &timer;
        let commit_cpu = t.cpu.get(&Phase::Commit).copied().unwrap_or_default();
        let mut p = t.p.clone();
        p.build_ms = t.wall_ms(Phase::Build);
        p.state_ms = t.wall_ms(Phase::State);
        p.plan_ms = t.wall_ms(Phase::Plan);
        p.kernel_ms = t.wall_ms(Phase::Commit);
        p.kernel_user_ms = ms(commit_cpu.0);
        p.kernel_sys_ms = ms(commit_cpu.1);
        p.state_update_ms = t.wall_ms(Phase::StateUpdate);
        p.cleanup_ms = t.wall_ms(Phase::Cleanup);
        p.frontends_ms = t.wall_ms(Phase::Conntrack);
        p.free_ms = t.wall_ms(Phase::Free);
        p.other_ms = p.state_update_ms + p.cleanup_ms + p.frontends_ms + p.free_ms;
        p.total_ms = total;
        p.user_ms = user;
        p.sys_ms = sys;
        p.ops = report.ops;
        p.messages = report.messages;
        p.bytes = report.bytes;
        Ok(p)
    }

    fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
        changed: Changed<'_>,
    ) -> Result<BTreeMap<String, Phases>> {
        let mut out = BTreeMap::new();
        for family in Family::ALL {
            out.insert(
                family.k8s_name().to_string(),
                self.sync_family(cluster, config, family, full, changed)?,
            );
        }
        Ok(out)
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PhasedResult {
    /// By family (`IPv4`, `IPv6`).
    pub cold: BTreeMap<String, Phases>,
    /// By operation key, then family; medians over the repetitions.
    pub partial: BTreeMap<String, BTreeMap<String, Phases>>,
}

/// The same syncs as [`syncer_bench`], with every phase timed, in another fresh namespace.
pub fn phased_bench(
    label: &str,
    cluster: &Cluster,
    config: &BuildConfig,
    n: usize,
    k: usize,
    reps: usize,
) -> Result<PhasedResult> {
    let ns = Netns::create(label)?;
    ns.run_in(|| {
        let mut config = config.clone();
        config.local_addresses = nftproxy::addresses::local_addresses();
        let mut cluster = cluster.clone();
        let mut phased = Phased {
            syncer: Syncer::new().context("opening the Syncer")?,
        };
        let mut out = PhasedResult {
            cold: phased.sync(&cluster, &config, true, Changed::All)?,
            ..PhasedResult::default()
        };
        let mut runs: BTreeMap<(String, String), Vec<Phases>> = BTreeMap::new();
        for rep in 0..WARM_UP_ROUNDS + reps {
            for op in PartialOp::ALL {
                let changed = op.apply(&mut cluster, n, k, rep)?;
                let phases = phased.sync(&cluster, &config, false, Changed::Services(&changed))?;
                if rep < WARM_UP_ROUNDS {
                    continue;
                }
                for (family, p) in phases {
                    runs.entry((op.key().to_string(), family))
                        .or_default()
                        .push(p);
                }
            }
        }
        for ((op, family), v) in runs {
            out.partial
                .entry(op)
                .or_default()
                .insert(family, Phases::median(&v));
        }
        Ok(out)
    })
}

// ---------------------------------------------------------------------------------------------
// Child processes

/// How a child process ended, with its resource usage (wait4).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChildRun {
    pub wall_ms: f64,
    pub user_ms: f64,
    pub sys_ms: f64,
    /// Peak resident set size, KiB: the child's VmHWM, polled while it runs. (Its ru_maxrss
    /// would start at the bench's own RSS: std spawns with vfork, and exec takes the
    /// high-water mark of the memory it leaves, which is the bench's.)
    pub max_rss_kib: u64,
    pub status: i32,
}

/// Waits for child `pid` with wait4 (std's `Child` must not wait for it too). With `block`
/// false, returns `None` if it has not exited yet.
fn wait4(pid: u32, start: Instant, block: bool) -> Result<Option<ChildRun>> {
    let mut status: libc::c_int = 0;
    let flags = if block { 0 } else { libc::WNOHANG };
    // SAFETY: wait4 on our own child, filling locally owned structs.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        loop {
            let rc = libc::wait4(pid as libc::pid_t, &mut status, flags, &mut ru);
            if rc == pid as libc::pid_t {
                break;
            }
            if rc == 0 {
                return Ok(None);
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err).context("wait4");
            }
        }
        ru
    };
    netns::unregister_child(pid);
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    Ok(Some(ChildRun {
        wall_ms: ms(start.elapsed()),
        user_ms: ms(tv(ru.ru_utime)),
        sys_ms: ms(tv(ru.ru_stime)),
        max_rss_kib: 0,
        status: code,
    }))
}

/// SIGTERM, up to 10 s to exit, then SIGKILL; reaps the child.
fn terminate(pid: u32, start: Instant) -> Result<ChildRun> {
    // SAFETY: kill(2) of our own child, not yet reaped (so its PID cannot be reused).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    for _ in 0..200 {
        if let Some(run) = wait4(pid, start, false)? {
            return Ok(run);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    Ok(wait4(pid, start, true)?.expect("blocking wait4 returns the child"))
}

/// Runs `cmd` to completion with its stderr in `stderr_file`; the run and its resources.
fn run_child(mut cmd: Command, stderr_file: &Path) -> Result<ChildRun> {
    let err = std::fs::File::create(stderr_file)?;
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err);
    let start = Instant::now();
    let child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let pid = child.id();
    netns::register_child(pid);
    let mut hwm_mib: f64 = 0.0;
    let mut run = loop {
        // A zombie has no memory left to report: the last reading before exit is the peak.
        if let Ok((_, hwm)) = process_rss(pid) {
            hwm_mib = hwm_mib.max(hwm);
        }
        if let Some(run) = wait4(pid, start, false)? {
            break run;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    run.max_rss_kib = (hwm_mib * 1024.0) as u64;
    if run.status != 0 {
        let text = std::fs::read_to_string(stderr_file).unwrap_or_default();
        let tail: String = text.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
        bail!("{cmd:?} exited with {}: {tail}", run.status);
    }
    Ok(run)
}

// ---------------------------------------------------------------------------------------------
// The kube-proxy-shaped baseline

#[derive(Clone, Debug, Default, Serialize)]
pub struct BaselineResult {
    /// `nft -f` of the full table into an empty namespace.
    pub full: ChildRun,
    pub text_bytes: usize,
    pub text_lines: usize,
    /// `nft -f` of one more Service on top (median of the repetitions).
    pub add_service_ms: f64,
    pub add_service_runs_ms: Vec<f64>,
}

pub fn baseline_bench(
    label: &str,
    cluster: &Cluster,
    n: usize,
    k: usize,
    reps: usize,
    dir: &Path,
) -> Result<BaselineResult> {
    use crate::kubeproxy::{Env, full_text, one_service_text};
    let env = Env {
        node_name: synth::NODE,
        cluster_cidr: synth::CLUSTER_CIDR_V4,
    };
    let text = full_text(cluster, &env, synth::SERVICE_CIDR_V4, synth::NODE_IP_V4);
    let file = dir.join(format!("kube-proxy-{n}.nft"));
    std::fs::write(&file, &text)?;
    let mut out = BaselineResult {
        text_bytes: text.len(),
        text_lines: text.lines().count(),
        ..BaselineResult::default()
    };
    drop(text);
    let ns = Netns::create(label)?;
    let mut cmd = ns.command("nft")?;
    cmd.arg("-f").arg(&file);
    out.full = run_child(cmd, &dir.join("nft.err")).context("nft -f (full)")?;
    let _ = std::fs::remove_file(&file);
    let mut cluster = cluster.clone();
    for rep in 0..reps {
        let spec = synth::extra_spec(n, rep, k);
        let mut objects = vec![spec.service()];
        objects.extend(spec.slices());
        synth::add_to_cluster(&mut cluster, &objects)?;
        let svc = &cluster.services[&spec.object_name()];
        let text = one_service_text(&cluster, svc, &env);
        let file = dir.join("kube-proxy-add.nft");
        std::fs::write(&file, &text)?;
        let mut cmd = ns.command("nft")?;
        cmd.arg("-f").arg(&file);
        let run = run_child(cmd, &dir.join("nft.err")).context("nft -f (one Service)")?;
        out.add_service_runs_ms.push(run.wall_ms);
    }
    out.add_service_ms = median(out.add_service_runs_ms.clone());
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The real agent

#[derive(Clone, Debug, Default, Serialize)]
pub struct AgentResult {
    pub file_bytes: u64,
    /// `nftproxy run --once --from-file`: parse, convert, one full sync, exit.
    pub once: ChildRun,
    /// `nftproxy run --from-file` (the daemon): time until both families were committed.
    pub daemon_first_sync_ms: f64,
    /// VmRSS of the daemon after its first sync (steady state), MiB.
    pub daemon_rss_mib: f64,
    /// VmHWM (peak RSS) of the daemon, MiB.
    pub daemon_peak_rss_mib: f64,
    /// CPU (user+sys, all threads) the daemon used over the idle window, ms.
    pub idle_cpu_ms: f64,
    pub idle_window_s: f64,
    /// How long `nft delete table ip nftproxy` took (while the daemon's drift monitor listens,
    /// the kernel builds a notification for every object it deletes), ms.
    pub table_delete_ms: f64,
    /// From the end of that `nft delete` until the daemon committed the IPv4 table again: the
    /// drift monitor's notice and a full sync rebuilding it, ms.
    pub daemon_repair_ms: f64,
}

/// What the daemon's log said so far.
#[derive(Default)]
struct DaemonLog {
    /// "nftables sync committed" lines, and those of them for IPv4.
    commits: usize,
    ipv4_commits: usize,
    /// The first lines, for error messages.
    head: Vec<String>,
    closed: bool,
}

pub fn agent_bench(
    label: &str,
    agent: &Path,
    objects_file: &Path,
    config_file: &Path,
    file_bytes: u64,
    idle: Duration,
    dir: &Path,
) -> Result<AgentResult> {
    let mut out = AgentResult {
        file_bytes,
        idle_window_s: idle.as_secs_f64(),
        ..AgentResult::default()
    };
    {
        let ns = Netns::create(&format!("{label}-once"))?;
        let mut cmd = ns.command(agent)?;
        cmd.args(["run", "--once", "--from-file"])
            .arg(objects_file)
            .arg("--config")
            .arg(config_file)
            .env("RUST_LOG", "info");
        out.once = run_child(cmd, &dir.join("agent-once.err")).context("nftproxy run --once")?;
    }
    if idle.is_zero() {
        return Ok(out);
    }
    let ns = Netns::create(&format!("{label}-daemon"))?;
    let mut cmd = ns.command(agent)?;
    cmd.args(["run", "--from-file"])
        .arg(objects_file)
        .arg("--config")
        .arg(config_file)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let pid = child.id();
    netns::register_child(pid);
    let stderr = child.stderr.take().expect("piped stderr");
    let seen = Arc::new((Mutex::new(DaemonLog::default()), Condvar::new()));
    {
        let seen = seen.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let (lock, cv) = &*seen;
                let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
                if line.contains("nftables sync committed") {
                    st.commits += 1;
                    if line.contains("IPv4") {
                        st.ipv4_commits += 1;
                    }
                }
                if st.head.len() < 50 {
                    st.head.push(line);
                }
                cv.notify_all();
            }
            let (lock, cv) = &*seen;
            lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            cv.notify_all();
        });
    }
    // Waits until `done` holds for the daemon's log.
    let wait_log = |what: &str, done: &dyn Fn(&DaemonLog) -> bool| -> Result<()> {
        let (lock, cv) = &*seen;
        let deadline = Instant::now() + Duration::from_secs(900);
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !done(&st) {
            ensure!(
                !st.closed,
                "the agent exited before {what}: {}",
                st.head.join(" | ")
            );
            let now = Instant::now();
            ensure!(now < deadline, "no {what} after 900 s");
            st = cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    };
    let result = (|| -> Result<()> {
        // One "nftables sync committed" line per family.
        wait_log("its first sync", &|st| st.commits >= Family::ALL.len())?;
        out.daemon_first_sync_ms = ms(start.elapsed());
        // Let the sync loop and the file watcher settle.
        std::thread::sleep(Duration::from_secs(1));
        let cpu0 = process_cpu(pid)?;
        std::thread::sleep(idle);
        let cpu1 = process_cpu(pid)?;
        out.idle_cpu_ms = ms(cpu1.saturating_sub(cpu0));
        let (rss, hwm) = process_rss(pid)?;
        out.daemon_rss_mib = rss;
        out.daemon_peak_rss_mib = hwm;
        // Someone deletes the table: the drift monitor notices, a full sync rebuilds it.
        let before = seen
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ipv4_commits;
        let delete = Instant::now();
        let status = ns
            .command("nft")?
            .args(["delete", "table", "ip", "nftproxy"])
            .status()?;
        ensure!(status.success(), "nft delete table failed: {status}");
        out.table_delete_ms = ms(delete.elapsed());
        let repair = Instant::now();
        wait_log("the repair", &|st| st.ipv4_commits > before)?;
        out.daemon_repair_ms = ms(repair.elapsed());
        Ok(())
    })();
    let _ = terminate(pid, start);
    drop(child);
    result.map(|()| out)
}

/// utime + stime of all threads of `pid` (`/proc/<pid>/stat`).
fn process_cpu(pid: u32) -> Result<Duration> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("bad /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is index 0, utime is field 14 overall (index 11 here).
    let utime: u64 = fields.get(11).context("no utime")?.parse()?;
    let stime: u64 = fields.get(12).context("no stime")?.parse()?;
    // SAFETY: sysconf has no memory effects.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(Duration::from_secs_f64((utime + stime) as f64 / tck))
}

/// VmRSS and VmHWM of `pid`, MiB.
fn process_rss(pid: u32) -> Result<(f64, f64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<f64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name}"))?;
        let kib: f64 = line
            .split_whitespace()
            .nth(1)
            .context("bad status line")?
            .parse()?;
        Ok(kib / 1024.0)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

// ---------------------------------------------------------------------------------------------
// First-packet latency

#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyStats {
    pub connections: usize,
    pub failures: usize,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyResult {
    /// Through the ClusterIP with only that Service loaded.
    pub one_service: LatencyStats,
    /// Through the ClusterIP with the N synthetic Services loaded as well.
    pub loaded: LatencyStats,
    /// Straight to the pod (no DNAT), with one and with N Services loaded: the floor.
    pub direct_one_service: LatencyStats,
    pub direct_loaded: LatencyStats,
}

const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const ECHO_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 3);
const ECHO_VIP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
const POD_GATEWAY: &str = "169.254.1.1";

/// node ─ vp1 ─ client pod (10.0.0.2), node ─ vp2 ─ echo pod (10.0.0.3); nothing else.
struct Lab {
    node: Netns,
    client: Netns,
    echo: Netns,
}

impl Lab {
    fn create(label: &str) -> Result<Lab> {
        let node = Netns::create(&format!("{label}-node"))?;
        node.sysctl(&[
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ])?;
        let client = Netns::create(&format!("{label}-client"))?;
        let echo = Netns::create(&format!("{label}-echo"))?;
        for (link, pod, ip) in [("vp1", &client, CLIENT_IP), ("vp2", &echo, ECHO_IP)] {
            node.ip_batch(&[
                &format!(
                    "link add {link} type veth peer name eth0 netns {}",
                    pod.name()
                ),
                &format!("link set {link} up"),
                &format!("addr add {POD_GATEWAY}/32 dev {link} scope link"),
                &format!("route add {ip}/32 dev {link}"),
            ])?;
            pod.ip_batch(&[
                "link set eth0 up",
                &format!("addr add {ip}/32 dev eth0"),
                &format!("route add {POD_GATEWAY} dev eth0 scope link"),
                &format!("route add default via {POD_GATEWAY} dev eth0"),
            ])?;
        }
        Ok(Lab { node, client, echo })
    }

    fn sync(&self, cluster: &Cluster, config: &BuildConfig) -> Result<()> {
        self.node.run_in(|| {
            let mut config = config.clone();
            config.local_addresses = nftproxy::addresses::local_addresses();
            Syncer::new()?.sync(cluster, &config, true)?;
            Ok(())
        })
    }

    /// Connect times (µs) of `count` connections to `dst` after `warmup` unmeasured ones, and
    /// the number of measured connections that failed.
    fn connect_times(&self, dst: SocketAddr, count: usize, warmup: usize) -> Result<Samples> {
        self.client.run_in(|| {
            let mut times = Vec::with_capacity(count);
            let mut failures = 0;
            for i in 0..warmup + count {
                let t = Instant::now();
                match TcpStream::connect_timeout(&dst, Duration::from_secs(1)) {
                    Ok(s) => {
                        let elapsed = t.elapsed();
                        // Close with RST: no TIME_WAIT, no lingering conntrack entries.
                        let linger = libc::linger {
                            l_onoff: 1,
                            l_linger: 0,
                        };
                        // SAFETY: setsockopt on an open socket with a correctly sized value.
                        unsafe {
                            libc::setsockopt(
                                s.as_raw_fd(),
                                libc::SOL_SOCKET,
                                libc::SO_LINGER,
                                (&linger as *const libc::linger).cast(),
                                size_of::<libc::linger>() as libc::socklen_t,
                            )
                        };
                        if i >= warmup {
                            times.push(elapsed.as_secs_f64() * 1e6);
                        }
                    }
                    Err(_) if i >= warmup => failures += 1,
                    Err(_) => {}
                }
            }
            Ok(Samples { times, failures })
        })
    }
}

/// Connect times of one kind of connection, gathered over several rounds.
#[derive(Default)]
struct Samples {
    times: Vec<f64>,
    failures: usize,
}

impl Samples {
    fn add(&mut self, more: Samples) {
        self.times.extend(more.times);
        self.failures += more.failures;
    }

    fn stats(mut self, what: &str) -> Result<LatencyStats> {
        let count = self.times.len() + self.failures;
        ensure!(
            self.failures * 100 <= count,
            "{} of {count} connections {what} failed",
            self.failures
        );
        self.times.sort_by(f64::total_cmp);
        let times = &self.times;
        Ok(LatencyStats {
            connections: times.len(),
            failures: self.failures,
            p50_us: percentile(times, 0.50),
            p90_us: percentile(times, 0.90),
            p99_us: percentile(times, 0.99),
            mean_us: times.iter().sum::<f64>() / times.len().max(1) as f64,
        })
    }
}

/// An accept-and-close TCP server on `ECHO_IP:8080` in `ns`, until `stop`.
fn echo_server(ns: &Netns, stop: Arc<AtomicBool>) -> Result<std::thread::JoinHandle<()>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let file = std::fs::File::open(Path::new("/run/netns").join(ns.name()))?;
    let handle = std::thread::spawn(move || {
        // SAFETY: setns(2) on an open namespace file; affects only this thread.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let _ = tx.send(Err(std::io::Error::last_os_error()));
            return;
        }
        let listener = match TcpListener::bind((ECHO_IP, synth::TARGET_PORT))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
        {
            Ok(l) => l,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        let _ = tx.send(Ok(()));
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((s, _)) => drop(s),
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    });
    rx.recv()
        .context("echo server thread died")?
        .context("echo server")?;
    Ok(handle)
}

/// Rounds the connections of each kind are spread over (see [`latency_bench`]).
const LATENCY_ROUNDS: usize = 10;

/// First-packet latency with one Service, and with `cluster` loaded as well, in two labs side by
/// side. The connections alternate between the labs in rounds, so that both see the machine in
/// the same state: measured one after the other, the two figures moved apart by up to ±30% on
/// this VM whatever was loaded, as did the direct connections without any DNAT.
pub fn latency_bench(
    label: &str,
    cluster: &Cluster,
    config: &BuildConfig,
    count: usize,
) -> Result<LatencyResult> {
    let one_lab = Lab::create(&format!("{label}-1"))?;
    let loaded_lab = Lab::create(&format!("{label}-n"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let servers = [
        echo_server(&one_lab.echo, stop.clone())?,
        echo_server(&loaded_lab.echo, stop.clone())?,
    ];
    let result = (|| -> Result<LatencyResult> {
        let echo = synth::echo_objects(ECHO_VIP, ECHO_IP);
        let mut one = synth::to_cluster(&synth::base_objects())?;
        synth::add_to_cluster(&mut one, &echo)?;
        let mut loaded = cluster.clone();
        synth::add_to_cluster(&mut loaded, &echo)?;
        one_lab.sync(&one, config)?;
        loaded_lab.sync(&loaded, config)?;
        let vip = SocketAddr::from((ECHO_VIP, synth::PORT));
        let direct = SocketAddr::from((ECHO_IP, synth::TARGET_PORT));
        let warmup = (count / 10).max(50);
        let kinds = [
            (&one_lab, direct),
            (&one_lab, vip),
            (&loaded_lab, direct),
            (&loaded_lab, vip),
        ];
        for (lab, dst) in kinds {
            lab.connect_times(dst, 0, warmup)?;
        }
        let mut samples: [Samples; 4] = Default::default();
        let per_round = count.div_ceil(LATENCY_ROUNDS);
        for round in 0..LATENCY_ROUNDS {
            // Each round in another order, so that no kind always follows the same one.
            for i in 0..kinds.len() {
                let k = (i + round) % kinds.len();
                let (lab, dst) = kinds[k];
                samples[k].add(lab.connect_times(dst, per_round, 0)?);
            }
        }
        let [direct_one, one_service, direct_loaded, loaded] = samples;
        Ok(LatencyResult {
            one_service: one_service.stats("through the ClusterIP, one Service")?,
            loaded: loaded.stats("through the ClusterIP, all Services")?,
            direct_one_service: direct_one.stats("to the pod, one Service")?,
            direct_loaded: direct_loaded.stats("to the pod, all Services")?,
        })
    })();
    stop.store(true, Ordering::Relaxed);
    for server in servers {
        let _ = server.join();
    }
    result
}
