//! One sync: build the desired tables, plan against what the kernel holds, commit.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dataplane::build::{BuildConfig, NoLocalEndpoints, build};
use dataplane::conntrack::{Frontends, cleanup_needed};
use dataplane::model::Cluster;
use dataplane::plan::{TableState, plan, plan_cleanup};
use dataplane::ruleset::Family;
use metrics::ObjectCounts;

use crate::conntrack::Conntrack;
use crate::nftables::{ApplyStats, NftError, Nftables};

/// What one family's sync sent to the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FamilyReport {
    pub ops: usize,
    pub messages: usize,
    pub bytes: usize,
    pub no_local_endpoints: NoLocalEndpoints,
    /// The objects of the table as committed (metrics).
    pub objects: ObjectCounts,
    /// The stale-chain cleanup transaction failed (it is retried by a later sync).
    pub cleanup_failed: bool,
    /// A full sync found the table changed by someone else and repaired it.
    pub drift_repaired: bool,
    /// How long this family's sync took.
    pub elapsed: Duration,
}

/// Keeps the kernel's nftproxy tables equal to the cluster model, sending only differences.
pub struct Syncer {
    nft: Nftables,
    /// What the kernel holds after our last successful commit; `None` when unknown (startup,
    /// after a failure, or when a full sync asks to re-read it), and then read back.
    committed: BTreeMap<Family, Option<Option<TableState>>>,
    /// For the UDP conntrack cleanup; `None` if the socket could not be opened.
    conntrack: Option<Conntrack>,
    /// The UDP frontends as of the last sync whose conntrack cleanup succeeded (or was not
    /// needed); absent at startup and then taken from the table read back from the kernel.
    udp_frontends: BTreeMap<Family, Frontends>,
    /// The family whose sync failed last (for per-family failure metrics).
    failed_family: Option<Family>,
}

impl Syncer {
    pub fn new() -> Result<Syncer, NftError> {
        Ok(Syncer {
            nft: Nftables::open()?,
            committed: BTreeMap::new(),
            conntrack: Conntrack::open()
                .inspect_err(|e| tracing::warn!(error = %e, "no UDP conntrack cleanup"))
                .ok(),
            udp_frontends: BTreeMap::new(),
            failed_family: None,
        })
    }

    /// Syncs both families. `full` re-reads the kernel state first, which repairs any drift.
    pub fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
    ) -> Result<BTreeMap<Family, FamilyReport>, NftError> {
        let mut reports = BTreeMap::new();
        for family in Family::ALL {
            let report = self.sync_family(cluster, config, family, full);
            if report.is_err() {
                self.committed.remove(&family);
                self.failed_family = Some(family);
            }
            reports.insert(family, report?);
        }
        Ok(reports)
    }

    fn sync_family(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        family: Family,
        full: bool,
    ) -> Result<FamilyReport, NftError> {
        let start = Instant::now();
        let built = build(cluster, config, family);
        let current = match self.committed.get(&family) {
            Some(Some(state)) if !full => state.clone(),
            _ => self.nft.read_table(family)?,
        };
        // A full sync that reads back something other than what we committed found drift.
        let drifted = full
            && matches!(self.committed.get(&family), Some(Some(committed)) if *committed != current);
        // At startup, what the previous run programmed tells which UDP frontends existed.
        let read_back = (!self.udp_frontends.contains_key(&family))
            .then(|| Frontends::from_table_state(current.as_ref()));
        let tx = plan(current.as_ref(), &built.table);
        let stats = self.nft.apply(&tx)?;
        let mut state = current.unwrap_or_default();
        state.apply(&tx);
        let cleanup = plan_cleanup(&state, &built.table);
        let mut cleanup_stats = ApplyStats::default();
        let mut cleanup_failed = false;
        if !cleanup.is_empty() {
            // Chains that just lost their last reference may still be busy on older kernels;
            // they stay (empty) and are deleted by a later sync.
            match self.nft.apply(&cleanup) {
                Ok(s) => {
                    state.apply(&cleanup);
                    cleanup_stats = s;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "stale chains not deleted yet");
                    cleanup_failed = true;
                }
            }
        }
        self.committed.insert(family, Some(Some(state)));
        let mut report = FamilyReport {
            ops: tx.ops.len() + cleanup.ops.len(),
            messages: stats.messages + cleanup_stats.messages,
            bytes: stats.bytes + cleanup_stats.bytes,
            no_local_endpoints: built.no_local_endpoints,
            objects: ObjectCounts::of(&built.table),
            cleanup_failed,
            drift_repaired: drifted && !tx.is_empty(),
            elapsed: Duration::ZERO,
        };
        tracing::info!(
            family = family.k8s_name(),
            full,
            ops = report.ops,
            messages = report.messages,
            bytes = report.bytes,
            "nftables sync committed"
        );
        self.clean_conntrack(family, Frontends::of(cluster, family), read_back);
        report.elapsed = start.elapsed();
        Ok(report)
    }

    /// After a commit that changed a UDP Service's frontends or serving endpoints, deletes the
    /// UDP conntrack entries that still lead to endpoints no longer serving (or to frontends that
    /// are gone), so that their next packet is load-balanced afresh. A failure is logged and
    /// retried at the next sync; it never fails the sync.
    fn clean_conntrack(
        &mut self,
        family: Family,
        current: Frontends,
        read_back: Option<Frontends>,
    ) {
        let (previous, exact) = match self.udp_frontends.remove(&family) {
            Some(previous) => (previous, true),
            None => (read_back.unwrap_or_default(), false),
        };
        let Some(ct) = self.conntrack.as_mut() else {
            self.udp_frontends.insert(family, current);
            return;
        };
        if !cleanup_needed(&previous, exact, &current) {
            self.udp_frontends.insert(family, current);
            return;
        }
        let start = Instant::now();
        match ct.clean_stale_udp(family, &current, &previous) {
            Ok(stats) => {
                metrics::observe_conntrack(family, start.elapsed(), stats.deleted as u64);
                tracing::info!(
                    family = family.k8s_name(),
                    listed = stats.listed,
                    stale = stats.stale,
                    deleted = stats.deleted,
                    elapsed = ?start.elapsed(),
                    "UDP conntrack cleanup"
                );
                self.udp_frontends.insert(family, current);
            }
            Err(e) => {
                // kube-proxy observes the duration of failed reconciles too.
                metrics::observe_conntrack(family, start.elapsed(), 0);
                tracing::warn!(
                    family = family.k8s_name(),
                    error = %e,
                    elapsed = ?start.elapsed(),
                    "UDP conntrack cleanup failed, retrying at the next sync"
                );
                if exact {
                    self.udp_frontends.insert(family, previous);
                }
            }
        }
    }

    /// The family whose sync failed last, if any failed.
    pub fn failed_family(&self) -> Option<Family> {
        self.failed_family
    }

    /// The netlink port id of the kernel connection (to recognise our own changes).
    pub fn portid(&self) -> u32 {
        self.nft.portid()
    }

    /// Removes nftproxy's tables from the kernel.
    pub fn cleanup(&mut self) -> Result<(), NftError> {
        for family in Family::ALL {
            if self.nft.delete_table(family)? {
                tracing::info!(
                    table = format!("{} nftproxy", family.nft_name()),
                    "deleted table"
                );
            }
            self.committed.remove(&family);
        }
        Ok(())
    }
}
