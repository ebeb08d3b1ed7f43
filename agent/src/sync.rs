//! One sync: build the desired tables, plan against what the kernel holds, commit.

use std::collections::BTreeMap;

use dataplane::build::{BuildConfig, NoLocalEndpoints, build};
use dataplane::model::Cluster;
use dataplane::plan::{TableState, plan, plan_cleanup};
use dataplane::ruleset::Family;

use crate::nftables::{ApplyStats, NftError, Nftables};

/// What one family's sync sent to the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FamilyReport {
    pub ops: usize,
    pub messages: usize,
    pub bytes: usize,
    pub no_local_endpoints: NoLocalEndpoints,
}

/// Keeps the kernel's nftproxy tables equal to the cluster model, sending only differences.
pub struct Syncer {
    nft: Nftables,
    /// What the kernel holds after our last successful commit; `None` when unknown (startup,
    /// after a failure, or when a full sync asks to re-read it), and then read back.
    committed: BTreeMap<Family, Option<Option<TableState>>>,
}

impl Syncer {
    pub fn new() -> Result<Syncer, NftError> {
        Ok(Syncer {
            nft: Nftables::open()?,
            committed: BTreeMap::new(),
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
        let built = build(cluster, config, family);
        let current = match self.committed.get(&family) {
            Some(Some(state)) if !full => state.clone(),
            _ => self.nft.read_table(family)?,
        };
        let tx = plan(current.as_ref(), &built.table);
        let stats = self.nft.apply(&tx)?;
        let mut state = current.unwrap_or_default();
        state.apply(&tx);
        let cleanup = plan_cleanup(&state, &built.table);
        let mut cleanup_stats = ApplyStats::default();
        if !cleanup.is_empty() {
            // Chains that just lost their last reference may still be busy on older kernels;
            // they stay (empty) and are deleted by a later sync.
            match self.nft.apply(&cleanup) {
                Ok(s) => {
                    state.apply(&cleanup);
                    cleanup_stats = s;
                }
                Err(e) => tracing::debug!(error = %e, "stale chains not deleted yet"),
            }
        }
        self.committed.insert(family, Some(Some(state)));
        let report = FamilyReport {
            ops: tx.ops.len() + cleanup.ops.len(),
            messages: stats.messages + cleanup_stats.messages,
            bytes: stats.bytes + cleanup_stats.bytes,
            no_local_endpoints: built.no_local_endpoints,
        };
        tracing::info!(
            family = family.k8s_name(),
            full,
            ops = report.ops,
            messages = report.messages,
            bytes = report.bytes,
            "nftables sync committed"
        );
        Ok(report)
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
