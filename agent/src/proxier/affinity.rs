//! One family's session-affinity cleanup after its commits: the entries of the shared affinity
//! map whose endpoint left their destination are deleted, as kube-proxy deletes an endpoint's
//! affinity set with its chain (see `dataplane::nft::build::affinity`).

use dataplane::nft::build::affinity::{cleanup_needed, stale_entries};
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
        let needed = self.pending || scope.is_none_or(|s| cleanup_needed(table, &s.elements));
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
