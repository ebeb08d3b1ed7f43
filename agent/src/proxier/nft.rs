//! The nftables proxier of one family: its desired table, what it knows of the kernel's, its
//! UDP conntrack bookkeeping, and one `sync`.

use std::time::{Duration, Instant};

use dataplane::conntrack::Frontends;
use dataplane::model::Cluster;
use dataplane::nft::build::BuildConfig;
use dataplane::nft::cold::{ELEMENTS_PER_STAGE, ELEMENTS_PER_STAGE_HEARD, split_cold_elements};
use dataplane::nft::desired::{Before, Desired, Scope, Updated};
use dataplane::nft::plan::{
    RULES_PER_STAGE, plan, plan_cleanup, plan_cleanup_scope, plan_scope, split_new_chains,
};
use dataplane::nft::ruleset::{Family, Table};
use dataplane::nft::state::TableState;
use dataplane::nft::transaction::Transaction;
use metrics::ObjectCounts;

use super::affinity::AffinityCleanup;
use super::udp::UdpCleanup;
use super::{ChangedServices, FamilyReport, Phase, Probe, Proxier, QUIET_MIN_OBJECTS, SyncError};
use crate::config::ProxyMode;
use crate::nftables::kernel::NftKernel;
use crate::nftables::monitor::Quieter;
use crate::nftables::{ApplyStats, NftError};

/// Keeps table `nftproxy` of one family equal to the cluster model, sending only differences.
pub struct NftProxier<K> {
    family: Family,
    kernel: K,
    /// What the kernel holds after our last successful commit; `None` when unknown (startup,
    /// after a failure, while a sync runs), and then read back. `Some(None)`: there is no
    /// table.
    committed: Option<Option<TableState>>,
    /// The desired table, updated Service by Service; `None` until the first build and after
    /// a failure.
    desired: Option<Desired>,
    udp: UdpCleanup,
    affinity: AffinityCleanup,
}

impl<K: NftKernel> NftProxier<K> {
    pub fn new(family: Family, kernel: K, udp: UdpCleanup) -> NftProxier<K> {
        NftProxier {
            family,
            kernel,
            committed: None,
            desired: None,
            udp,
            affinity: AffinityCleanup::new(family),
        }
    }

    fn try_sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
        changed: ChangedServices<'_>,
        probe: &mut dyn Probe,
    ) -> Result<FamilyReport, NftError> {
        let family = self.family;
        let first = self.udp.first();
        probe.enter(family, Phase::State);
        // A table programmed by a previous run is read before the first build, whose Service
        // chains then keep their endpoint-map regions (and so their rules).
        let fresh = self.desired.is_none();
        let committed_from = self.desired.as_ref().map(Desired::table);
        let current = current_state(
            &mut self.kernel,
            family,
            &mut self.committed,
            full,
            fresh,
            committed_from,
        )?;
        probe.enter(family, Phase::Build);
        let kernel = current.state.as_ref().filter(|_| fresh);
        let updated = update_desired(&mut self.desired, cluster, config, family, changed, kernel);
        let desired = self.desired.as_ref().expect("just built");
        let Current {
            state: current,
            read,
            drifted,
        } = current;
        probe.enter(family, Phase::Conntrack);
        // At startup, what the previous run programmed tells which UDP frontends existed.
        let read_back = first.then(|| Frontends::from_table_state(current.as_ref()));
        probe.enter(family, Phase::Plan);
        let table = desired.table();
        // A state read back may lack changes an earlier, failed sync was about to make: compare
        // all (its sets carry the elements read back, so what the update changed is not needed).
        let (scope, before) = match (&current, updated, read) {
            (Some(_), Updated::Scope(scope), false) => (Some(scope), Before::Nothing),
            (_, Updated::All(before), false) => (None, before),
            _ => (None, Before::Nothing),
        };
        let tx = match (&current, &scope) {
            (Some(cur), Some(scope)) => plan_scope(cur, table, scope),
            _ => plan(current.as_ref(), &before, table),
        };
        drop(before);
        let drift_repaired = drifted && !tx.is_empty();
        let big = tx.objects() >= QUIET_MIN_OBJECTS;
        let parts = split_new_chains(current.as_ref(), tx, RULES_PER_STAGE);
        // A new table's elements go in parts, which a process listening to nf_tables
        // notifications slows much less than one large transaction; smaller ones while one
        // listens (every commit costs a walk of every chain in the namespace).
        let per_part = if current.is_none() && self.kernel.others_listen() {
            tracing::info!(
                family = family.k8s_name(),
                elements = ELEMENTS_PER_STAGE_HEARD,
                "another process listens to nf_tables notifications: the new table goes in smaller parts"
            );
            ELEMENTS_PER_STAGE_HEARD
        } else {
            ELEMENTS_PER_STAGE
        };
        let parts = split_cold_elements(current.as_ref(), parts, per_part);
        let mut state = current.unwrap_or_default();
        // Once `parts` commit, every set holds the desired table's elements; the elements
        // read back are no longer needed (should a part fail, the state is read back again).
        state.settle();
        let commit = |kernel: &mut K| {
            commit_and_clean_up(kernel, parts, &mut state, scope.as_ref(), table, probe)
        };
        let sent = if big {
            self.kernel.quietly(commit)
        } else {
            commit(&mut self.kernel)
        }?;
        self.committed = Some(Some(state));
        let (chains, rules, sets, set_elements) = desired.object_counts();
        let report = FamilyReport {
            ops: sent.ops,
            messages: sent.stats.messages,
            bytes: sent.stats.bytes,
            no_local_endpoints: desired.no_local_endpoints(),
            objects: ObjectCounts {
                chains,
                rules,
                sets,
                set_elements,
            },
            cleanup_failed: sent.cleanup_failed,
            drift_repaired,
            elapsed: Duration::ZERO,
            iptables: None,
        };
        tracing::info!(
            family = family.k8s_name(),
            full,
            ops = report.ops,
            messages = report.messages,
            bytes = report.bytes,
            "nftables sync committed"
        );
        // What the kernel keeps of connections and clients: UDP conntrack entries and
        // session-affinity entries whose endpoints are gone.
        probe.enter(family, Phase::Conntrack);
        self.affinity
            .synced(&mut self.kernel, table, scope.as_ref());
        drop(scope);
        self.udp.synced(cluster, changed, read_back);
        Ok(report)
    }
}

impl<K: NftKernel> Proxier for NftProxier<K> {
    fn family(&self) -> Family {
        self.family
    }

    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
        changed: ChangedServices<'_>,
        probe: &mut dyn Probe,
    ) -> Result<FamilyReport, SyncError> {
        if crate::testhooks::fail_family(self.family) {
            self.forget();
            return Err(SyncError::Injected(self.family.k8s_name()));
        }
        let start = Instant::now();
        match self.try_sync(cluster, config, full, changed, probe) {
            Ok(mut report) => {
                report.elapsed = start.elapsed();
                probe.enter(self.family, Phase::Done);
                Ok(report)
            }
            Err(e) => {
                // The next sync reads the kernel back and rebuilds.
                self.forget();
                probe.enter(self.family, Phase::Done);
                Err(e.into())
            }
        }
    }

    fn programmed_node_port_ips(&mut self) -> Vec<std::net::IpAddr> {
        let Ok(Some(table)) = self.kernel.read_table(self.family) else {
            return Vec::new();
        };
        let Some(elements) = table
            .sets
            .get(dataplane::nft::build::NODEPORT_IPS)
            .and_then(|s| s.elements.read())
        else {
            return Vec::new();
        };
        elements
            .keys()
            .filter_map(|k| match k {
                dataplane::nft::ruleset::Key::Addr(ip) => Some(ip),
                _ => None,
            })
            .collect()
    }

    fn set_quieter(&mut self, quieter: std::sync::Arc<Quieter>) {
        self.kernel.set_quieter(quieter);
    }

    fn portid(&self) -> Option<u32> {
        self.kernel.portid()
    }

    fn cleanup(&mut self) -> Result<(), SyncError> {
        let tx = Transaction {
            family: self.family,
            ops: vec![dataplane::nft::transaction::Op::DeleteTable],
        };
        match self.kernel.apply(&tx) {
            Ok(_) => tracing::info!(
                table = format!(
                    "{} {}",
                    self.family.nft_name(),
                    dataplane::nft::ruleset::TABLE
                ),
                "deleted table"
            ),
            // There is none.
            Err(e) if e.errno() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e.into()),
        }
        self.committed = None;
        self.udp.forget();
        Ok(())
    }

    fn remove_other_backend(&mut self) {
        use crate::iptables::{Owner, remove_chains_of};
        match remove_chains_of(Owner::Nftproxy, &[self.family]) {
            Ok(removed) => {
                super::log_removed(&removed, "deleted iptables chains left by iptables mode")
            }
            Err(e) => tracing::warn!(error = %e, "cannot remove iptables-mode leftovers"),
        }
    }
}

impl<K> NftProxier<K> {
    /// Forgets what it knew of the kernel and its desired table.
    fn forget(&mut self) {
        self.committed = None;
        self.desired = None;
        self.udp.forget_index();
    }
}

/// Takes the committed state out (while the sync runs it is unknown, should the sync fail), or
/// reads the table from the kernel: on a full sync, before the first build, and when nothing
/// was committed. `committed_from` is the desired table of the last sync.
fn current_state<K: NftKernel>(
    kernel: &mut K,
    family: Family,
    committed: &mut Option<Option<TableState>>,
    full: bool,
    fresh: bool,
    committed_from: Option<&Table>,
) -> Result<Current, NftError> {
    match committed.take() {
        Some(state) if !full && !fresh => Ok(Current {
            state,
            read: false,
            drifted: false,
        }),
        previous => {
            let state = kernel.read_table(family)?;
            // Drift: the kernel holds something other than what was committed.
            let agrees = |previous: &Option<TableState>| match (previous, &state) {
                (Some(p), Some(read)) => committed_from.is_some_and(|t| p.agrees_with(read, t)),
                (p, read) => p.is_none() && read.is_none(),
            };
            Ok(Current {
                drifted: full && previous.is_some_and(|p| !agrees(&p)),
                state,
                read: true,
            })
        }
    }
}

/// Brings the desired table up to date: in place for the changed Services, or rebuilt (the
/// first build adopting the endpoint-map regions of `kernel`'s table).
fn update_desired(
    desired: &mut Option<Desired>,
    cluster: &Cluster,
    config: &BuildConfig,
    family: Family,
    changed: ChangedServices<'_>,
    kernel: Option<&TableState>,
) -> Updated {
    match (desired.as_mut(), changed) {
        (Some(d), ChangedServices::Services(names)) => d.update(cluster, config, names),
        (Some(d), ChangedServices::All) => Updated::All(Before::Sets(d.rebuild(cluster, config))),
        (None, _) => {
            *desired = Some(match kernel {
                Some(state) => Desired::build_adopting(cluster, config, family, state),
                None => Desired::build(cluster, config, family),
            });
            Updated::All(Before::Nothing)
        }
    }
}

/// The kernel's table as a sync starts from it.
struct Current {
    state: Option<TableState>,
    /// Read from the kernel just now, rather than what the last sync committed.
    read: bool,
    /// A full sync read back something other than what was committed.
    drifted: bool,
}

/// What [`commit_and_clean_up`] sent.
struct Sent {
    ops: usize,
    stats: ApplyStats,
    /// The cleanup transaction failed (its chains are deleted by a later sync).
    cleanup_failed: bool,
}

/// Commits `parts`, keeping `state` up to date as each one commits, then deletes the chains
/// nothing refers to any more.
fn commit_and_clean_up<K: NftKernel>(
    kernel: &mut K,
    parts: Vec<Transaction>,
    state: &mut TableState,
    scope: Option<&Scope>,
    table: &Table,
    probe: &mut dyn Probe,
) -> Result<Sent, NftError> {
    let family = table.family;
    let mut ops = 0;
    probe.enter(family, Phase::Commit);
    let mut stats = kernel.apply_all(parts, &mut |part| {
        probe.enter(family, Phase::StateUpdate);
        ops += part.ops.len();
        state.apply(part);
        probe.enter(family, Phase::Commit);
    })?;
    probe.enter(family, Phase::Cleanup);
    let cleanup = match scope {
        Some(scope) => plan_cleanup_scope(state, table, scope),
        None => plan_cleanup(state, table),
    };
    let mut cleanup_failed = false;
    if !cleanup.is_empty() {
        // Chains that just lost their last reference may still be busy on older kernels;
        // they stay (empty) and are deleted by a later sync.
        match kernel.apply(&cleanup) {
            Ok(s) => {
                state.apply(&cleanup);
                stats.messages += s.messages;
                stats.bytes += s.bytes;
            }
            Err(e) => {
                tracing::debug!(error = %e, "stale chains not deleted yet");
                cleanup_failed = true;
            }
        }
    }
    probe.enter(family, Phase::Free);
    Ok(Sent {
        ops: ops + cleanup.ops.len(),
        stats,
        cleanup_failed,
    })
}
