//! One family's UDP conntrack cleanup after its commits, shared by both backends.

use std::borrow::Cow;
use std::time::Instant;

use dataplane::conntrack::{FrontendIndex, FrontendKeys, Frontends, cleanup_needed};
use dataplane::model::Cluster;
use dataplane::nft::ruleset::Family;

use super::ChangedServices;
use crate::conntrack::Conntrack;

/// What one family knows of its UDP frontends, and the conntrack socket to clean up with.
pub struct UdpCleanup {
    family: Family,
    /// `None` if the socket could not be opened (or in tests): the bookkeeping goes on.
    conntrack: Option<Conntrack>,
    /// The UDP frontends as of the last sync whose conntrack cleanup succeeded (or was not
    /// needed); absent at startup and then taken from the table read back from the kernel.
    frontends: Option<Frontends>,
    /// The UDP frontends the cluster gives now, kept per Service.
    index: Option<FrontendIndex>,
    /// Frontends whose conntrack cleanup failed, compared again at the next sync.
    pending: Option<FrontendKeys>,
    /// A sync or a cleanup failed since `frontends` were recorded: flows may have been DNATed
    /// to endpoints they lack (a partial commit, rules whose cleanup did not happen), so that
    /// endpoints added since do not show that nothing is stale. The next cleanup runs whenever
    /// UDP frontends are in its scope, as when the previous endpoints are unknown.
    unsure: bool,
}

impl UdpCleanup {
    pub fn new(family: Family, conntrack: Option<Conntrack>) -> UdpCleanup {
        UdpCleanup {
            family,
            conntrack,
            frontends: None,
            index: None,
            pending: None,
            unsure: false,
        }
    }

    /// Opens the conntrack socket of the calling thread's namespace (logging if it cannot).
    pub fn open(family: Family) -> UdpCleanup {
        let conntrack = Conntrack::open()
            .inspect_err(|e| tracing::warn!(error = %e, "no UDP conntrack cleanup"))
            .ok();
        UdpCleanup::new(family, conntrack)
    }

    /// No sync of this family has succeeded yet.
    pub fn first(&self) -> bool {
        self.frontends.is_none()
    }

    /// After a failed sync: the frontends the cluster gives are rebuilt at the next one, whose
    /// cleanup runs (the failed sync may have committed part of its rules).
    pub fn forget_index(&mut self) {
        self.index = None;
        self.unsure = true;
    }

    /// After a cleanup of the rules: every frontend is new again.
    pub fn forget(&mut self) {
        self.frontends = None;
        self.pending = None;
        self.unsure = false;
    }

    /// After a commit: brings the frontends up to date with `cluster` and cleans up.
    /// `read_back`: on the first sync, the frontends the previous run programmed.
    pub fn synced(
        &mut self,
        cluster: &Cluster,
        changed: ChangedServices<'_>,
        read_back: Option<Frontends>,
    ) {
        let touched = match (self.index.as_mut(), changed) {
            (Some(index), ChangedServices::Services(names)) => Some(index.update(cluster, names)),
            _ => {
                self.index = Some(FrontendIndex::build(cluster, self.family));
                None
            }
        };
        self.clean(touched, read_back);
    }

    /// After a commit that changed a UDP Service's frontends or serving endpoints (other than
    /// by only adding endpoints to frontends that had some: see [`cleanup_needed`]), deletes the
    /// UDP conntrack entries that still lead to endpoints no longer serving (or to frontends
    /// that are gone), so that their next packet is load-balanced afresh. A failure is logged
    /// and retried at the next sync; it never fails the sync.
    ///
    /// `touched` holds the frontends the sync's changes may have altered (`None`: any); only
    /// those are compared with the previous ones.
    fn clean(&mut self, touched: Option<FrontendKeys>, read_back: Option<Frontends>) {
        let family = self.family;
        let Some(index) = self.index.as_ref() else {
            return;
        };
        let current = index.current();
        let pending = self.pending.take();
        let (mut previous, exact) = match self.frontends.take() {
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
            self.frontends = Some(previous);
            self.unsure = false;
            return;
        };
        if !cleanup_needed(&was, exact && !self.unsure, &now) {
            cleaned(&mut previous);
            self.frontends = Some(previous);
            self.unsure = false;
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
                self.frontends = Some(previous);
                self.unsure = false;
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
                    match &scope {
                        Some(keys) => previous.add_missing(&current.restricted(keys)),
                        None => previous.add_missing(current),
                    }
                    self.frontends = Some(previous);
                    self.pending = scope;
                    self.unsure = true;
                }
            }
        }
    }
}
