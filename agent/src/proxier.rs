//! One sync of each IP family, by that family's proxier.
//!
//! As in kube-proxy, each family has a [`Proxier`] of its own that owns everything the family
//! needs (its desired rules, what it knows of the kernel, its UDP conntrack bookkeeping) and
//! forgets what it knew of the kernel when a sync fails, so that the next one starts afresh.
//! [`Syncer`] holds one per family (kube-proxy's dual-stack `metaProxier`). The nftables
//! proxier ([`nft::NftProxier`]) programs a kernel through the [`NftKernel`] interface:
//! nf_tables over netlink, or the in-memory fake of the unit tests; the iptables proxier
//! ([`ipt::IptablesProxier`]) runs iptables-restore.

mod affinity;
pub mod ipt;
pub mod nft;
#[cfg(test)]
pub(crate) mod testkit;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod thin_tests;
pub mod udp;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use dataplane::iptables::IptablesOptions;
use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::{BuildConfig, NoLocalEndpoints};
use dataplane::nft::ruleset::{Family, TABLE};
use metrics::ObjectCounts;

use crate::config::ProxyMode;
use crate::iptables::{self, IptError, IptablesBackend, IptablesCounts, Owner, Variant};
use crate::nftables::kernel::{Netlink, NftKernel};
use crate::nftables::monitor::Quieter;
use crate::nftables::{NftError, Nftables};

use self::ipt::IptablesProxier;
use self::nft::NftProxier;
use self::udp::UdpCleanup;

/// kube-proxy's nftables table (`nftproxy cleanup --kube-proxy`).
pub const KUBE_PROXY_TABLE: &str = "kube-proxy";

/// Transactions of at least this many objects (elements, rules, chains, sets) are committed
/// with the drift monitor's notifications paused ([`Quieter`]): the kernel builds one for each
/// object, so counting ops (a 5,000-endpoint Service is three) would leave the largest
/// partial syncs notified (a whole 5,000-endpoint Service took 8 ms to add instead of 4.7 at
/// 100k Services). Smaller ones are left alone: pausing saves them about 10 µs, while any other
/// process's commit to any table during a pause counts as possible drift, which costs a full
/// sync.
pub const QUIET_MIN_OBJECTS: usize = 100;

/// Why a sync (or a cleanup) failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Nftables(#[from] NftError),
    #[error(transparent)]
    Iptables(#[from] IptError),
    /// `NFTPROXY_TEST_FAIL_FAMILY` (see [`crate::testhooks`]).
    #[error("{0} sync failed by NFTPROXY_TEST_FAIL_FAMILY (a test hook)")]
    Injected(&'static str),
}

impl SyncError {
    /// The nftables operation the kernel or the encoder refused, if that was the failure.
    pub fn refused_op(&self) -> Option<&dataplane::nft::transaction::Op> {
        match self {
            SyncError::Nftables(e) => e.refused_op(),
            _ => None,
        }
    }
}

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
    /// iptables mode: rules owned and written per table (kube-proxy's iptables gauges).
    pub iptables: Option<IptablesCounts>,
}

/// Which Services changed since the previous sync.
#[derive(Clone, Copy, Debug)]
pub enum ChangedServices<'a> {
    /// Unknown, or something every Service depends on: consider them all.
    All,
    /// Only these (created, updated or deleted).
    Services(&'a BTreeSet<ObjectName>),
}

/// Where a family's sync is, for a [`Probe`] timing it (the benchmark). An nftables sync
/// enters State, Build, Conntrack (the frontends read back), Plan, Commit (interrupted by
/// StateUpdate after each committed part), Cleanup, Free, Conntrack (the cleanup)
/// and Done; an iptables sync only Commit, Conntrack and Done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Reading the table back, or taking the committed state.
    State,
    /// Building or updating the desired table.
    Build,
    /// The UDP frontends: read back before planning, kept and cleaned up after the commit.
    Conntrack,
    /// Planning the transaction.
    Plan,
    /// Encoding and committing it (the kernel's work included).
    Commit,
    /// Keeping the committed state up to date.
    StateUpdate,
    /// Planning and committing the deletion of chains nothing refers to any more.
    Cleanup,
    /// Freeing the transactions and the change's scope.
    Free,
    /// The sync is over (successful or not).
    Done,
}

/// Told when a family's sync enters each [`Phase`].
pub trait Probe {
    fn enter(&mut self, family: Family, phase: Phase);
}

impl Probe for () {
    fn enter(&mut self, _: Family, _: Phase) {}
}

/// One family's proxier: keeps the kernel's rules for that family equal to the cluster model.
pub trait Proxier: Send {
    fn family(&self) -> Family;

    fn mode(&self) -> ProxyMode;

    /// Syncs the family after the Services in `changed` changed (the work is proportional to
    /// the change where the backend can tell), or in `full` (the kernel read back first, which
    /// repairs drift). A failure makes the proxier forget what it knew of the kernel, so the
    /// next sync reads it back and rebuilds.
    fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
        changed: ChangedServices<'_>,
        probe: &mut dyn Probe,
    ) -> Result<FamilyReport, SyncError>;

    /// The addresses the kernel's table serves NodePorts on: what an earlier run programmed
    /// from this node's Node object. Empty when unknown.
    fn programmed_node_port_ips(&mut self) -> Vec<std::net::IpAddr> {
        Vec::new()
    }

    /// Leaves the drift monitor's notifications out of large transactions (nftables).
    fn set_quieter(&mut self, _quieter: Arc<Quieter>) {}

    /// The netlink port id of the kernel connection (to recognise our own changes).
    fn portid(&self) -> Option<u32> {
        None
    }

    /// iptables mode: the variant in use.
    fn iptables_variant(&self) -> Option<Variant> {
        None
    }

    /// Removes what this proxier created for its family; the next sync starts afresh.
    fn cleanup(&mut self) -> Result<(), SyncError>;

    /// Removes what the *other* mode left behind for this family, as kube-proxy does when it
    /// starts. Failures are logged, never fatal.
    fn remove_other_backend(&mut self);
}

/// One proxier per IP family (kube-proxy's dual-stack wrapper).
pub struct Syncer {
    proxiers: BTreeMap<Family, Box<dyn Proxier>>,
}

impl Syncer {
    /// An nftables-mode syncer over netlink in the calling thread's namespace.
    pub fn new() -> Result<Syncer, NftError> {
        let netlink = Netlink::open()?;
        Ok(Syncer::nftables(|family| {
            (netlink.clone(), UdpCleanup::open(family))
        }))
    }

    /// An nftables-mode syncer whose families program `kernel(family)`.
    pub fn nftables<K: NftKernel + 'static>(
        mut kernel: impl FnMut(Family) -> (K, UdpCleanup),
    ) -> Syncer {
        Syncer::with_proxiers(Family::ALL.map(|family| {
            let (k, udp) = kernel(family);
            Box::new(NftProxier::new(family, k, udp)) as Box<dyn Proxier>
        }))
    }

    /// A syncer for `mode`; iptables mode uses the iptables variant the node uses.
    pub fn for_mode(mode: ProxyMode, options: &IptablesOptions) -> Result<Syncer, SyncError> {
        Ok(match mode {
            ProxyMode::Nftables => Syncer::new()?,
            ProxyMode::Iptables => Syncer::iptables(IptablesBackend::detect_variant(), options)?,
        })
    }

    /// An iptables-mode syncer using `variant`.
    pub fn iptables(variant: Variant, options: &IptablesOptions) -> Result<Syncer, SyncError> {
        let mut proxiers: Vec<Box<dyn Proxier>> = Vec::new();
        for family in Family::ALL {
            let backend = IptablesBackend::with_variant(variant, family, options.clone())?;
            let udp = UdpCleanup::open(family);
            proxiers.push(Box::new(IptablesProxier::new(backend, udp)));
        }
        Ok(Syncer::with_proxiers(proxiers))
    }

    /// A syncer driving these proxiers (one per family).
    pub fn with_proxiers(proxiers: impl IntoIterator<Item = Box<dyn Proxier>>) -> Syncer {
        Syncer {
            proxiers: proxiers.into_iter().map(|p| (p.family(), p)).collect(),
        }
    }

    /// The families this syncer programs.
    pub fn families(&self) -> impl Iterator<Item = Family> + '_ {
        self.proxiers.keys().copied()
    }

    /// The proxier of `family`.
    pub fn proxier(&mut self, family: Family) -> Option<&mut (dyn Proxier + 'static)> {
        self.proxiers.get_mut(&family).map(|p| &mut **p)
    }

    pub fn mode(&self) -> ProxyMode {
        self.proxiers
            .values()
            .next()
            .map_or(ProxyMode::Nftables, |p| p.mode())
    }

    /// iptables mode: the variant in use.
    pub fn iptables_variant(&self) -> Option<Variant> {
        self.proxiers.values().find_map(|p| p.iptables_variant())
    }

    /// The addresses the kernel's tables serve NodePorts on (nftables mode): what an earlier
    /// run programmed from this node's Node object, for when that object cannot be had. Empty
    /// in iptables mode, when there is no table, or when it cannot be read.
    pub fn programmed_node_port_ips(&mut self) -> Vec<std::net::IpAddr> {
        self.proxiers
            .values_mut()
            .flat_map(|p| p.programmed_node_port_ips())
            .collect()
    }

    /// Syncs both families, considering every Service. `full` re-reads the kernel state first,
    /// which repairs any drift. The first failure is returned.
    pub fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
    ) -> Result<BTreeMap<Family, FamilyReport>, SyncError> {
        let all = self.families().map(|f| (f, full)).collect();
        self.sync_families(cluster, config, &all, ChangedServices::All)
            .into_iter()
            .map(|(family, r)| r.map(|report| (family, report)))
            .collect()
    }

    /// Syncs each family of `families` (with whether to sync it in full) after the Services in
    /// `changed` changed. Each family is synced by its own proxier: one failing does not stop
    /// or delay the other. In nftables mode, syncs that consider every Service (a cold start,
    /// a full sync) run both families at once: one family builds its table while the kernel
    /// commits the other's, which the shared netlink connection serialises. Small syncs stay
    /// on the calling thread, where a thread's start would cost more than it saves.
    pub fn sync_families(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        families: &BTreeMap<Family, bool>,
        changed: ChangedServices<'_>,
    ) -> BTreeMap<Family, Result<FamilyReport, SyncError>> {
        let large = matches!(changed, ChangedServices::All) || families.values().any(|&f| f);
        let at_once = large && self.mode() == ProxyMode::Nftables;
        let mut work: Vec<(Family, bool, &mut Box<dyn Proxier>)> = self
            .proxiers
            .iter_mut()
            .filter_map(|(family, p)| families.get(family).map(|&full| (*family, full, p)))
            .collect();
        let sync = |(family, full, p): (Family, bool, &mut Box<dyn Proxier>)| {
            (family, p.sync(cluster, config, full, changed, &mut ()))
        };
        if !at_once || work.len() < 2 {
            return work.into_iter().map(sync).collect();
        }
        let first = work.remove(0);
        std::thread::scope(|s| {
            let others: Vec<_> = work.into_iter().map(|w| s.spawn(move || sync(w))).collect();
            let mut results = BTreeMap::from([sync(first)]);
            for handle in others {
                // A panic in a proxier is a bug either way: let it surface as on one thread.
                let (family, result) = handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                results.insert(family, result);
            }
            results
        })
    }

    /// nftables mode: leaves the drift monitor's notifications out of transactions of
    /// [`QUIET_MIN_OBJECTS`] objects or more (see [`Quieter`]).
    pub fn set_quieter(&mut self, q: Quieter) {
        let q = Arc::new(q);
        for p in self.proxiers.values_mut() {
            p.set_quieter(q.clone());
        }
    }

    /// nftables mode: the netlink port id of the kernel connection (to recognise our own
    /// changes).
    pub fn portid(&self) -> Option<u32> {
        self.proxiers.values().find_map(|p| p.portid())
    }

    /// Removes what this syncer's proxiers created: nftproxy's nftables tables, or its
    /// iptables chains (in the variant in use). The next sync starts afresh.
    pub fn cleanup(&mut self) -> Result<(), SyncError> {
        for p in self.proxiers.values_mut() {
            p.cleanup()?;
        }
        Ok(())
    }

    /// Removes what the *other* mode left behind, as kube-proxy does when it starts: starting
    /// in iptables mode deletes nftproxy's nftables tables, starting in nftables mode deletes
    /// its iptables chains (both variants). Failures are logged, never fatal.
    pub fn remove_other_backend(&mut self) {
        for p in self.proxiers.values_mut() {
            p.remove_other_backend();
        }
    }
}

/// One line per cleanup (a node may have thousands of chains), the names at debug level.
fn log_removed(removed: &[String], message: &str) {
    if !removed.is_empty() {
        tracing::info!(count = removed.len(), "{message}");
        tracing::debug!(chains = ?removed, "{message}");
    }
}

/// Deletes table `name` in both families.
fn delete_tables(nft: &mut Nftables, name: &str) -> Result<(), NftError> {
    for family in Family::ALL {
        if nft.delete_named_table(family, name)? {
            tracing::info!(
                table = format!("{} {name}", family.nft_name()),
                "deleted table"
            );
        }
    }
    Ok(())
}

/// `nftproxy cleanup`: removes everything nftproxy created in either mode — its nftables
/// tables and its iptables chains in both variants — or, with `kube_proxy`, only kube-proxy's
/// leftovers (tables `ip kube-proxy` / `ip6 kube-proxy`, its `KUBE-` iptables chains).
/// Tries everything; returns the first error.
pub fn cleanup_all(kube_proxy: bool) -> Result<(), SyncError> {
    let mut first_error: Option<SyncError> = None;
    let mut note = |r: Result<(), SyncError>| {
        if let Err(e) = r {
            tracing::warn!(error = %e, "cleanup step failed");
            first_error.get_or_insert(e);
        }
    };
    // Either nftproxy's own objects or kube-proxy's, never both: `--kube-proxy` runs on nodes
    // where nftproxy is already serving, during a migration.
    let (table, owner) = if kube_proxy {
        (KUBE_PROXY_TABLE, Owner::KubeProxy)
    } else {
        (TABLE, Owner::Nftproxy)
    };
    note(
        Nftables::open()
            .map_err(SyncError::from)
            .and_then(|mut nft| Ok(delete_tables(&mut nft, table)?)),
    );
    note(
        iptables::remove_chains(owner)
            .map(|removed| log_removed(&removed, "deleted iptables chains"))
            .map_err(SyncError::from),
    );
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
