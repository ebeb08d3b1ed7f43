//! One family's session-affinity cleanup after its commits: the entries of the shared affinity
//! map whose endpoint left their destination are deleted, as kube-proxy deletes an endpoint's
//! affinity set with its chain (see `dataplane::nft::build::affinity`).

use dataplane::nft::build::affinity::{
    AFFINITY_NODEPORTS, AFFINITY_SERVICES, cleanup_needed, stale_entries,
};
use dataplane::nft::desired::Scope;
use dataplane::nft::ruleset::{Family, Table};

use crate::nftables::kernel::NftKernel;

pub struct AffinityCleanup {
    family: Family,
    /// Clean up at the next sync whatever it changes: the last cleanup failed, or deleted
    /// entries (a connection between its lookup and its record may have made one again).
    pending: bool,
}

impl AffinityCleanup {
    pub fn new(family: Family) -> AffinityCleanup {
        AffinityCleanup {
            family,
            pending: true,
        }
    }

    /// After a commit that made the kernel's table `table`: `scope` is what the sync changed
    /// (`None`: anything). Failures are logged and retried at the next sync.
    pub fn synced<K: NftKernel>(&mut self, kernel: &mut K, table: &Table, scope: Option<&Scope>) {
        let needed = self.pending
            || scope.is_none_or(|s| {
                // The sets of destinations with affinity first: one that got affinity decides
                // at once, before a large Service's thousands of list entries are compared.
                let (first, rest): (Vec<_>, Vec<_>) = s.elements.iter().partition(|(set, _)| {
                    [AFFINITY_SERVICES, AFFINITY_NODEPORTS].contains(&set.as_str())
                });
                let touched = first.into_iter().chain(rest).flat_map(|(set, keys)| {
                    keys.iter().map(move |(k, was)| (set.as_str(), k, was))
                });
                cleanup_needed(table, touched)
            });
        if !needed {
            return;
        }
        let family = self.family;
        let result = kernel.affinity_entries(family).and_then(|entries| {
            let stale = stale_entries(table, &entries);
            let deleted = match stale.is_empty() {
                true => 0,
                false => kernel.delete_affinity_entries(family, &stale)?,
            };
            Ok((entries.len(), deleted))
        });
        match result {
            Ok((listed, deleted)) => {
                self.pending = deleted > 0;
                if deleted > 0 {
                    tracing::info!(
                        family = family.k8s_name(),
                        listed,
                        deleted,
                        "deleted session-affinity entries of endpoints that are gone"
                    );
                }
            }
            Err(e) => {
                self.pending = true;
                tracing::warn!(
                    family = family.k8s_name(),
                    error = %e,
                    "session-affinity cleanup failed, retrying at the next sync"
                );
            }
        }
    }
}
