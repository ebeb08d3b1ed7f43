//! The iptables backend (kube-proxy's iptables mode, `mode: iptables`): for nodes where the
//! nftables backend cannot run.
//!
//! [`IptablesBackend::sync`] builds one family's desired rules (`dataplane::iptables::build`),
//! plans a full or partial restore against what the last successful restore wrote, and runs
//! `iptables-restore --noflush` / `ip6tables-restore --noflush` of the variant the node uses
//! ([`xtables::detect`]), waiting for the xtables lock like every other iptables user. A failed
//! restore forgets what was written, so the next sync is a full one.
//!
//! [`remove_chains`] removes chains by name in both variants and both families: nftproxy's own
//! (`nftproxy cleanup`, or starting in nftables mode) and kube-proxy's leftovers
//! (`nftproxy cleanup --kube-proxy`).

pub mod xtables;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dataplane::iptables::{
    self as ipt, CANARY, Existing, IptTable, IptablesOptions, Tables, parse_save, plan_full,
    plan_partial, plan_removal,
};
use dataplane::model::Cluster;
use dataplane::nft::build::{BuildConfig, NoLocalEndpoints};
use dataplane::nft::ruleset::Family;

pub use self::xtables::{Detection, IptError, Variant, Xtables, detect};

/// The sysctl that lets packets addressed to 127.0.0.0/8 be routed to an endpoint.
const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";

/// Rule counts of one family's sync (kube-proxy's `sync_proxy_rules_iptables_total` and
/// `sync_proxy_rules_iptables_last`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IptablesCounts {
    /// Rules in nftproxy's chains after the sync.
    pub filter_rules: usize,
    pub nat_rules: usize,
    /// Rules the restore wrote (`-A` and `-I`).
    pub filter_written: usize,
    pub nat_written: usize,
}

/// What one family's sync did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IptablesReport {
    pub full: bool,
    /// Size of the restore input (0 when nothing changed and no restore ran).
    pub lines: usize,
    pub bytes: usize,
    pub restores: usize,
    pub chains: usize,
    pub rules: usize,
    pub counts: IptablesCounts,
    pub no_local_endpoints: NoLocalEndpoints,
    pub elapsed: Duration,
}

/// Keeps one family's nftproxy iptables chains equal to the cluster model.
pub struct IptablesBackend {
    variant: Variant,
    family: Family,
    options: IptablesOptions,
    /// What the last successful restore left; absent when unknown (startup, after a failure).
    written: Option<Tables>,
    /// Logged once: route_localnet set or not settable, loopback NodePort addresses skipped.
    warned: BTreeMap<&'static str, bool>,
}

impl IptablesBackend {
    /// Picks the variant the node uses and logs the choice.
    pub fn detect_variant() -> Variant {
        let detection = detect();
        tracing::info!(
            variant = detection.variant.name(),
            reason = %detection.reason,
            "iptables mode: using iptables-{}",
            detection.variant
        );
        detection.variant
    }

    /// Programs `family` with `variant` (whose tools must be installed).
    pub fn with_variant(
        variant: Variant,
        family: Family,
        options: IptablesOptions,
    ) -> Result<IptablesBackend, IptError> {
        let x = Xtables::new(variant, family);
        if !x.available() {
            return Err(IptError::Missing {
                binary: x.binary_name("restore"),
            });
        }
        Ok(IptablesBackend {
            variant,
            family,
            options,
            written: None,
            warned: BTreeMap::new(),
        })
    }

    pub fn variant(&self) -> Variant {
        self.variant
    }

    pub fn family(&self) -> Family {
        self.family
    }

    fn warn_once(&mut self, key: &'static str) -> bool {
        !std::mem::replace(self.warned.entry(key).or_default(), true)
    }

    /// Syncs the family: a partial restore if what was written last is known and `full` is
    /// not asked for, else a full one.
    pub fn sync(
        &mut self,
        cluster: &Cluster,
        config: &BuildConfig,
        full: bool,
    ) -> Result<IptablesReport, IptError> {
        let start = Instant::now();
        let family = self.family;
        let x = Xtables::new(self.variant, family);
        let desired = ipt::build(cluster, config, &self.options, family);
        if !desired.skipped_loopback.is_empty() && self.warn_once("loopback") {
            tracing::error!(
                addresses = ?desired.skipped_loopback,
                "nodePortAddresses includes localhost, but localhost NodePorts are only \
                 supported for IPv4 with iptables.localhostNodePorts; skipping"
            );
        }
        if desired.route_localnet {
            self.ensure_route_localnet();
        }
        let partial = !full && self.written.is_some();
        let restore = match &self.written {
            Some(written) if partial => plan_partial(written, &desired),
            _ => {
                let existing = Existing::from_save(&x.save_ours()?);
                plan_full(&desired, &existing)
            }
        };
        if !restore.is_empty()
            && let Err(e) = x.restore(&restore.text)
        {
            self.written = None;
            let m = metrics::metrics();
            m.iptables_restore_failed(family, partial);
            tracing::debug!(input = %restore.text, "failed iptables-restore input");
            return Err(e);
        }
        let counts = IptablesCounts {
            filter_rules: desired.rule_count(IptTable::Filter),
            nat_rules: desired.rule_count(IptTable::Nat),
            filter_written: restore
                .rules_written
                .get(&IptTable::Filter)
                .copied()
                .unwrap_or(0),
            nat_written: restore
                .rules_written
                .get(&IptTable::Nat)
                .copied()
                .unwrap_or(0),
        };
        let report = IptablesReport {
            full: restore.full,
            lines: restore.lines(),
            bytes: restore.text.len(),
            restores: usize::from(!restore.is_empty()),
            chains: IptTable::ALL.iter().map(|t| desired.chain_count(*t)).sum(),
            rules: counts.filter_rules + counts.nat_rules,
            counts,
            no_local_endpoints: desired.no_local_endpoints,
            elapsed: start.elapsed(),
        };
        tracing::info!(
            family = family.k8s_name(),
            variant = self.variant.name(),
            full = report.full,
            lines = report.lines,
            bytes = report.bytes,
            chains_written = restore.chains_written,
            chains_deleted = restore.chains_deleted,
            filter_rules_written = counts.filter_written,
            nat_rules_written = counts.nat_written,
            elapsed = ?report.elapsed,
            "iptables restore committed"
        );
        self.written = Some(desired.tables);
        Ok(report)
    }

    /// Sets `net.ipv4.conf.all.route_localnet=1` (needed for NodePorts on 127.0.0.1), once.
    fn ensure_route_localnet(&mut self) {
        let current = std::fs::read_to_string(ROUTE_LOCALNET).unwrap_or_default();
        if current.trim() == "1" {
            return;
        }
        match std::fs::write(ROUTE_LOCALNET, "1") {
            Ok(()) => tracing::info!(
                "set net.ipv4.conf.all.route_localnet=1 to allow NodePorts on localhost; to \
                 change this, disable iptables.localhostNodePorts or set nodePortAddresses to \
                 exclude loopback addresses"
            ),
            Err(e) => {
                if self.warn_once("route_localnet") {
                    tracing::warn!(error = %e, "cannot set net.ipv4.conf.all.route_localnet=1; NodePorts on localhost will not work");
                }
            }
        }
    }

    /// Forgets what was written (the next sync is full).
    pub fn forget(&mut self) {
        self.written = None;
    }

    /// Removes nftproxy's chains of the family from this variant.
    pub fn cleanup(&mut self) -> Result<Vec<String>, IptError> {
        self.written = None;
        remove_in(Xtables::new(self.variant, self.family), &|c: &str| {
            c.starts_with(ipt::PREFIX)
        })
    }
}

/// Whether nftproxy's canary chains are still there (someone flushing the tables removes them).
/// `None` if the check itself failed.
pub fn canary_present(variant: Variant) -> Option<bool> {
    let mut all = true;
    for family in Family::ALL {
        let x = Xtables::new(variant, family);
        for table in IptTable::ALL {
            all &= x.chain_exists(table.name(), CANARY).ok()?;
        }
    }
    Some(all)
}

/// Whose chains [`remove_chains`] removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Every `NFTPROXY-` chain.
    Nftproxy,
    /// kube-proxy's iptables-mode chains (`KUBE-SERVICES`, `KUBE-SVC-...`; not kubelet's).
    KubeProxy,
}

fn remove_in(x: Xtables, pred: &dyn Fn(&str) -> bool) -> Result<Vec<String>, IptError> {
    // Every table the kernel has (without -t, legacy lists only loaded tables, creating none).
    let saved = parse_save(&x.save(None)?);
    let (text, removed) = plan_removal(&saved, pred);
    if text.is_empty() {
        return Ok(Vec::new());
    }
    x.restore(&text)?;
    Ok(removed
        .into_iter()
        .map(|c| format!("{} {}: {c}", x.binary_name(""), x.family.k8s_name()))
        .collect())
}

/// Removes `owner`'s chains (and the rules of built-in chains that jump to them) in both
/// variants and both families. A variant whose tools are not installed is skipped; the first
/// error is returned after trying everything. Returns what was removed, for logging.
pub fn remove_chains(owner: Owner) -> Result<Vec<String>, IptError> {
    remove_chains_of(owner, &Family::ALL)
}

/// [`remove_chains`] for the families in `families` only.
pub fn remove_chains_of(owner: Owner, families: &[Family]) -> Result<Vec<String>, IptError> {
    let pred: &dyn Fn(&str) -> bool = match owner {
        Owner::Nftproxy => &|c: &str| c.starts_with(ipt::PREFIX),
        Owner::KubeProxy => &ipt::is_kube_proxy_chain,
    };
    let mut removed = Vec::new();
    let mut first_error = None;
    for variant in Variant::ALL {
        for &family in families {
            let x = Xtables::new(variant, family);
            if !x.available() {
                tracing::debug!(binary = x.binary_name("save"), "not installed; skipped");
                continue;
            }
            match remove_in(x, pred) {
                Ok(r) => removed.extend(r),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot remove iptables chains");
                    first_error.get_or_insert(e);
                }
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(removed),
    }
}
