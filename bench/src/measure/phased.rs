//! The same syncs as the `Syncer` runs, timed phase by phase through the proxiers' probe.

use super::*;

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
    pub(super) fn median(runs: &[Phases]) -> Phases {
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
pub(super) struct PhaseTimer {
    pub(super) current: Option<(Phase, Instant, (Duration, Duration))>,
    pub(super) wall: BTreeMap<Phase, Duration>,
    pub(super) cpu: BTreeMap<Phase, (Duration, Duration)>,
    pub(super) heap_start: usize,
    pub(super) heap_entered: usize,
    pub(super) heap_planned: usize,
    pub(super) peak_before_apply: usize,
    pub(super) committing: bool,
    pub(super) p: Phases,
}

impl PhaseTimer {
    pub(super) fn new() -> PhaseTimer {
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

    pub(super) fn wall_ms(&self, phase: Phase) -> f64 {
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
pub(super) struct Phased {
    pub(super) syncer: Syncer,
    pub(super) _monitor: DriftMonitor,
}

impl Phased {
    pub(super) fn sync_family(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        family: Family,
        full: bool,
        changed: ChangedServices<'_>,
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

    pub(super) fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
        changed: ChangedServices<'_>,
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
        let (syncer, monitor) = drift::daemon_syncer()?;
        let mut phased = Phased {
            syncer,
            _monitor: monitor,
        };
        let mut out = PhasedResult {
            cold: phased.sync(&cluster, &config, true, ChangedServices::All)?,
            ..PhasedResult::default()
        };
        let mut runs: BTreeMap<(String, String), Vec<Phases>> = BTreeMap::new();
        for rep in 0..WARM_UP_ROUNDS + reps {
            for op in PartialOp::ALL {
                let changed = op.apply(&mut cluster, n, k, rep)?;
                let phases = phased.sync(
                    &cluster,
                    &config,
                    false,
                    ChangedServices::Services(&changed),
                )?;
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
