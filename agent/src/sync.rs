//! One sync: build the desired tables, plan against what the kernel holds, commit.
//!
//! A [`Syncer`] drives one of two backends, chosen by `mode`: nftables over netlink (the
//! default) or iptables-restore (kube-proxy's iptables mode, see [`crate::iptables`]). The UDP
//! conntrack cleanup after a commit is the same for both.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dataplane::build::{BuildConfig, NoLocalEndpoints};
use dataplane::conntrack::{FrontendIndex, FrontendKeys, Frontends, cleanup_needed};
use dataplane::desired::{Desired, Scope, Updated};
use dataplane::iptables::IptablesOptions;
use dataplane::model::{Cluster, ObjectName};
use dataplane::plan::{
    RULES_PER_PART, TableState, Transaction, plan, plan_cleanup, plan_cleanup_scope, plan_scope,
    split_new_chains,
};
use dataplane::ruleset::{Family, TABLE, Table};
use metrics::ObjectCounts;

use crate::config::ProxyMode;
use crate::conntrack::Conntrack;
use crate::iptables::{self, IptError, IptablesBackend, IptablesCounts, Owner, Variant};
use crate::nftables::monitor::Quieter;
use crate::nftables::{ApplyStats, NftError, Nftables};

/// kube-proxy's nftables table (`nftproxy cleanup --kube-proxy`).
pub const KUBE_PROXY_TABLE: &str = "kube-proxy";

/// Transactions of at least this many ops are committed with the drift monitor's
/// notifications paused ([`Quieter`]). Smaller ones are left alone: their notifications cost
/// about as much as the two generation reads that pausing takes.
pub const QUIET_MIN_OPS: usize = 100;

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
    pub fn refused_op(&self) -> Option<&dataplane::plan::Op> {
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
pub enum Changed<'a> {
    /// Unknown, or something every Service depends on: consider them all.
    All,
    /// Only these (created, updated or deleted).
    Services(&'a BTreeSet<ObjectName>),
}

/// The kernel interface a [`Syncer`] programs.
enum Backend {
    Nftables {
        nft: Nftables,
        /// What the kernel holds after our last successful commit; absent when unknown
        /// (startup, after a failure, or when a full sync asks to re-read it), and then read
        /// back. `None` inside: there is no table.
        committed: BTreeMap<Family, Option<TableState>>,
        /// The desired table per family, updated Service by Service.
        desired: BTreeMap<Family, Desired>,
        /// Keeps the drift monitor's notifications out of large transactions.
        quieter: Option<Quieter>,
    },
    Iptables(IptablesBackend),
}

/// Keeps the kernel's nftproxy rules equal to the cluster model, sending only differences.
pub struct Syncer {
    backend: Backend,
    /// For the UDP conntrack cleanup; `None` if the socket could not be opened.
    conntrack: Option<Conntrack>,
    /// The UDP frontends as of the last sync whose conntrack cleanup succeeded (or was not
    /// needed); absent at startup and then taken from the table read back from the kernel.
    udp_frontends: BTreeMap<Family, Frontends>,
    /// The UDP frontends the cluster gives now, kept per Service.
    udp_index: BTreeMap<Family, FrontendIndex>,
    /// Frontends whose conntrack cleanup failed, compared again at the next sync.
    udp_pending: BTreeMap<Family, FrontendKeys>,
}

impl Syncer {
    /// An nftables-mode syncer.
    pub fn new() -> Result<Syncer, NftError> {
        Ok(Syncer::with_backend(Backend::Nftables {
            nft: Nftables::open()?,
            committed: BTreeMap::new(),
            desired: BTreeMap::new(),
            quieter: None,
        }))
    }

    /// A syncer for `mode`; iptables mode uses the iptables variant the node uses.
    pub fn for_mode(mode: ProxyMode, options: &IptablesOptions) -> Result<Syncer, SyncError> {
        Ok(match mode {
            ProxyMode::Nftables => Syncer::new()?,
            ProxyMode::Iptables => {
                Syncer::with_backend(Backend::Iptables(IptablesBackend::new(options.clone())?))
            }
        })
    }

    /// An iptables-mode syncer using `variant`.
    pub fn iptables(variant: Variant, options: &IptablesOptions) -> Result<Syncer, SyncError> {
        Ok(Syncer::with_backend(Backend::Iptables(
            IptablesBackend::with_variant(variant, options.clone())?,
        )))
    }

    fn with_backend(backend: Backend) -> Syncer {
        Syncer {
            backend,
            conntrack: Conntrack::open()
                .inspect_err(|e| tracing::warn!(error = %e, "no UDP conntrack cleanup"))
                .ok(),
            udp_frontends: BTreeMap::new(),
            udp_index: BTreeMap::new(),
            udp_pending: BTreeMap::new(),
        }
    }

    pub fn mode(&self) -> ProxyMode {
        match self.backend {
            Backend::Nftables { .. } => ProxyMode::Nftables,
            Backend::Iptables(_) => ProxyMode::Iptables,
        }
    }

    /// iptables mode: the variant in use.
    pub fn iptables_variant(&self) -> Option<Variant> {
        match &self.backend {
            Backend::Nftables { .. } => None,
            Backend::Iptables(b) => Some(b.variant()),
        }
    }

    /// The addresses the kernel's tables serve NodePorts on (nftables mode): what an earlier
    /// run programmed from this node's Node object, for when that object cannot be had. Empty
    /// in iptables mode, when there is no table, or when it cannot be read.
    pub fn programmed_node_port_ips(&mut self) -> Vec<std::net::IpAddr> {
        let Backend::Nftables { nft, .. } = &mut self.backend else {
            return Vec::new();
        };
        let mut ips = Vec::new();
        for family in Family::ALL {
            let Ok(Some(table)) = nft.read_table(family) else {
                continue;
            };
            if let Some(set) = table.sets.get(dataplane::build::NODEPORT_IPS) {
                ips.extend(set.elements.keys().filter_map(|k| match k {
                    dataplane::ruleset::Key::Addr(ip) => Some(*ip),
                    _ => None,
                }));
            }
        }
        ips
    }

    /// Syncs both families, considering every Service. `full` re-reads the kernel state first,
    /// which repairs any drift. The first failure is returned.
    pub fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
    ) -> Result<BTreeMap<Family, FamilyReport>, SyncError> {
        let both = Family::ALL.iter().map(|f| (*f, full)).collect();
        self.sync_families(cluster, config, &both, Changed::All)
            .into_iter()
            .map(|(family, r)| r.map(|report| (family, report)))
            .collect()
    }

    /// Syncs each family of `families` (with whether to sync it in full) after the Services in
    /// `changed` changed: in nftables mode the work is proportional to the change, not to the
    /// cluster, unless full. Each family is synced on its own: one failing does not stop or
    /// delay the other. A failed family forgets what it knew of the kernel and its desired
    /// table, so its next sync reads the kernel back and rebuilds.
    pub fn sync_families(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        families: &BTreeMap<Family, bool>,
        changed: Changed<'_>,
    ) -> BTreeMap<Family, Result<FamilyReport, SyncError>> {
        let mut results = BTreeMap::new();
        for (&family, &full) in families {
            let result = self.sync_family(cluster, config, family, full, changed);
            if result.is_err() {
                self.udp_index.remove(&family);
                match &mut self.backend {
                    Backend::Nftables {
                        committed, desired, ..
                    } => {
                        committed.remove(&family);
                        desired.remove(&family);
                    }
                    // The backend forgets what it wrote itself.
                    Backend::Iptables(_) => {}
                }
            }
            results.insert(family, result);
        }
        results
    }

    fn sync_family(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        family: Family,
        full: bool,
        changed: Changed<'_>,
    ) -> Result<FamilyReport, SyncError> {
        if crate::testhooks::fail_family(family) {
            return Err(SyncError::Injected(family.k8s_name()));
        }
        let start = Instant::now();
        let first = !self.udp_frontends.contains_key(&family);
        let (mut report, read_back) = match &mut self.backend {
            Backend::Nftables {
                nft,
                committed,
                desired,
                quieter,
            } => {
                // A table programmed by a previous run is read before the first build, whose
                // Service chains then keep their endpoint-map regions (and so their rules).
                let fresh = !desired.contains_key(&family);
                let current = current_state(nft, committed, family, full, fresh)?;
                let kernel = current.state.as_ref().filter(|_| fresh);
                let desired = update_desired(desired, cluster, config, family, changed, kernel);
                let quieter = quieter.as_ref();
                let pass = Pass {
                    family,
                    full,
                    first,
                    current,
                };
                sync_nftables(nft, quieter, committed, desired, pass)?
            }
            Backend::Iptables(ipt) => {
                let r = ipt.sync_family(cluster, config, family, full)?;
                let report = FamilyReport {
                    ops: r.lines,
                    messages: r.restores,
                    bytes: r.bytes,
                    no_local_endpoints: r.no_local_endpoints,
                    objects: ObjectCounts {
                        chains: r.chains,
                        rules: r.rules,
                        sets: 0,
                        set_elements: 0,
                    },
                    iptables: Some(r.counts),
                    ..FamilyReport::default()
                };
                // What a previous run programmed is not read back in iptables mode: the first
                // conntrack cleanup treats every UDP Service as possibly changed.
                (report, None)
            }
        };
        let touched = match (self.udp_index.get_mut(&family), changed) {
            (Some(index), Changed::Services(names)) => Some(index.update(cluster, names)),
            _ => {
                self.udp_index
                    .insert(family, FrontendIndex::build(cluster, family));
                None
            }
        };
        self.clean_conntrack(family, touched, read_back);
        report.elapsed = start.elapsed();
        Ok(report)
    }

    /// After a commit that changed a UDP Service's frontends or serving endpoints, deletes the
    /// UDP conntrack entries that still lead to endpoints no longer serving (or to frontends that
    /// are gone), so that their next packet is load-balanced afresh. A failure is logged and
    /// retried at the next sync; it never fails the sync.
    ///
    /// `touched` holds the frontends the sync's changes may have altered (`None`: any); only
    /// those are compared with the previous ones.
    fn clean_conntrack(
        &mut self,
        family: Family,
        touched: Option<FrontendKeys>,
        read_back: Option<Frontends>,
    ) {
        let Some(index) = self.udp_index.get(&family) else {
            return;
        };
        let current = index.current();
        let pending = self.udp_pending.remove(&family);
        let (mut previous, exact) = match self.udp_frontends.remove(&family) {
            Some(previous) => (previous, true),
            None => (read_back.unwrap_or_default(), false),
        };
        let scope = touched.filter(|_| exact).map(|mut keys| {
            if let Some(p) = &pending {
                keys.extend(p);
            }
            keys
        });
        let (was, now) = match &scope {
            Some(keys) => (
                Cow::Owned(previous.restricted(keys)),
                Cow::Owned(current.restricted(keys)),
            ),
            None => (Cow::Borrowed(&previous), Cow::Borrowed(current)),
        };
        let cleaned = |previous: &mut Frontends| match &scope {
            Some(keys) => previous.replace(keys, current),
            None => *previous = current.clone(),
        };
        let Some(ct) = self.conntrack.as_mut() else {
            cleaned(&mut previous);
            self.udp_frontends.insert(family, previous);
            return;
        };
        if !cleanup_needed(&was, exact, &now) {
            cleaned(&mut previous);
            self.udp_frontends.insert(family, previous);
            return;
        }
        let start = Instant::now();
        match ct.clean_stale_udp(family, current, &was) {
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
                drop(was);
                cleaned(&mut previous);
                self.udp_frontends.insert(family, previous);
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
                drop(was);
                if exact {
                    self.udp_frontends.insert(family, previous);
                    if let Some(keys) = scope {
                        self.udp_pending.insert(family, keys);
                    }
                }
            }
        }
    }

    /// nftables mode: leaves the drift monitor's notifications out of transactions of
    /// [`QUIET_MIN_OPS`] ops or more (see [`Quieter`]).
    pub fn set_quieter(&mut self, q: Quieter) {
        if let Backend::Nftables { quieter, .. } = &mut self.backend {
            *quieter = Some(q);
        }
    }

    /// nftables mode: the netlink port id of the kernel connection (to recognise our own
    /// changes).
    pub fn portid(&self) -> Option<u32> {
        match &self.backend {
            Backend::Nftables { nft, .. } => Some(nft.portid()),
            Backend::Iptables(_) => None,
        }
    }

    /// Removes what this syncer's backend created: nftproxy's nftables tables, or its
    /// iptables chains (in the variant in use). The next sync starts afresh.
    pub fn cleanup(&mut self) -> Result<(), SyncError> {
        match &mut self.backend {
            Backend::Nftables { nft, committed, .. } => {
                delete_tables(nft, TABLE)?;
                committed.clear();
            }
            Backend::Iptables(ipt) => log_removed(&ipt.cleanup()?, "deleted iptables chains"),
        }
        self.udp_frontends.clear();
        self.udp_pending.clear();
        Ok(())
    }

    /// Removes what the *other* mode left behind, as kube-proxy does when it starts: starting
    /// in iptables mode deletes nftproxy's nftables tables, starting in nftables mode deletes
    /// its iptables chains (both variants). Failures are logged, never fatal.
    pub fn remove_other_backend(&mut self) {
        match &mut self.backend {
            Backend::Nftables { .. } => match iptables::remove_chains(Owner::Nftproxy) {
                Ok(removed) => {
                    log_removed(&removed, "deleted iptables chains left by iptables mode")
                }
                Err(e) => tracing::warn!(error = %e, "cannot remove iptables-mode leftovers"),
            },
            Backend::Iptables(_) => {
                if let Err(e) = Nftables::open().and_then(|mut nft| delete_tables(&mut nft, TABLE))
                {
                    tracing::warn!(error = %e, "cannot remove nftables-mode leftovers");
                }
            }
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

/// Brings `family`'s desired table up to date: in place for the changed Services, or rebuilt
/// (the first build adopting the endpoint-map regions of `kernel`'s table).
fn update_desired<'d>(
    desired: &'d mut BTreeMap<Family, Desired>,
    cluster: &Cluster,
    config: &BuildConfig,
    family: Family,
    changed: Changed<'_>,
    kernel: Option<&TableState>,
) -> (&'d Desired, Updated) {
    let updated = match (desired.get_mut(&family), changed) {
        (Some(d), Changed::Services(names)) => d.update(cluster, config, names),
        (Some(d), Changed::All) => {
            d.rebuild(cluster, config);
            Updated::All
        }
        (None, _) => {
            let built = match kernel {
                Some(state) => Desired::build_adopting(cluster, config, family, state),
                None => Desired::build(cluster, config, family),
            };
            desired.insert(family, built);
            Updated::All
        }
    };
    (&desired[&family], updated)
}

/// The kernel's table as one family's sync starts from it.
struct Current {
    state: Option<TableState>,
    /// Read from the kernel just now, rather than what the last sync committed.
    read: bool,
    /// A full sync read back something other than what was committed.
    drifted: bool,
}

/// Takes `family`'s committed state out (while the sync runs it is unknown, should the sync
/// fail), or reads the table from the kernel: on a full sync, before a family's first build,
/// and when nothing was committed.
fn current_state(
    nft: &mut Nftables,
    committed: &mut BTreeMap<Family, Option<TableState>>,
    family: Family,
    full: bool,
    fresh: bool,
) -> Result<Current, NftError> {
    match committed.remove(&family) {
        Some(state) if !full && !fresh => Ok(Current {
            state,
            read: false,
            drifted: false,
        }),
        previous => {
            let state = nft.read_table(family)?;
            Ok(Current {
                drifted: full && previous.is_some_and(|p| p != state),
                state,
                read: true,
            })
        }
    }
}

/// What one family's nftables sync is asked to do.
struct Pass {
    family: Family,
    full: bool,
    /// No sync of this family has succeeded yet.
    first: bool,
    current: Current,
}

/// One family's nftables sync: returns the report and, on the first sync, the UDP frontends
/// the previous run programmed (read back from the kernel).
fn sync_nftables(
    nft: &mut Nftables,
    quieter: Option<&Quieter>,
    committed: &mut BTreeMap<Family, Option<TableState>>,
    (desired, updated): (&Desired, Updated),
    pass: Pass,
) -> Result<(FamilyReport, Option<Frontends>), NftError> {
    let Pass {
        family,
        full,
        first,
        current:
            Current {
                state: current,
                read,
                drifted,
            },
    } = pass;
    // At startup, what the previous run programmed tells which UDP frontends existed.
    let read_back = first.then(|| Frontends::from_table_state(current.as_ref()));
    let table = desired.table();
    // A state read back may lack changes an earlier, failed sync was about to make: compare all.
    let scope = match (&current, updated, read) {
        (Some(_), Updated::Scope(scope), false) => Some(scope),
        _ => None,
    };
    let tx = match (&current, &scope) {
        (Some(cur), Some(scope)) => plan_scope(cur, table, scope),
        _ => plan(current.as_ref(), table),
    };
    let drift_repaired = drifted && !tx.is_empty();
    let big = tx.ops.len() >= QUIET_MIN_OPS;
    let parts = split_new_chains(current.as_ref(), tx, RULES_PER_PART);
    let mut state = current.unwrap_or_default();
    let commit =
        |nft: &mut Nftables| commit_and_clean_up(nft, parts, &mut state, scope.as_ref(), table);
    let sent = match quieter {
        Some(q) if big => q.around(nft, commit),
        _ => commit(nft),
    }?;
    committed.insert(family, Some(state));
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
    Ok((report, read_back))
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
fn commit_and_clean_up(
    nft: &mut Nftables,
    parts: Vec<Transaction>,
    state: &mut TableState,
    scope: Option<&Scope>,
    table: &Table,
) -> Result<Sent, NftError> {
    let mut ops = 0;
    let mut stats = nft.apply_all(parts, |part| {
        ops += part.ops.len();
        match scope {
            Some(_) => state.apply(part),
            None => state.apply_except_elements(part),
        }
    })?;
    if scope.is_none() {
        state.copy_elements(table);
    }
    let cleanup = match scope {
        Some(scope) => plan_cleanup_scope(state, table, scope),
        None => plan_cleanup(state, table),
    };
    let mut cleanup_failed = false;
    if !cleanup.is_empty() {
        // Chains that just lost their last reference may still be busy on older kernels;
        // they stay (empty) and are deleted by a later sync.
        match nft.apply(&cleanup) {
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
    Ok(Sent {
        ops: ops + cleanup.ops.len(),
        stats,
        cleanup_failed,
    })
}
