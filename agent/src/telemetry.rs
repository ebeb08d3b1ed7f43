//! Wires the sync loop to the observability surface: starts the metrics and health servers,
//! and after every sync records kube-proxy's metrics, the proxy health and the per-Service
//! health-check node ports (kube-proxy's post-sync steps, `syncProxyRules` step 7).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dataplane::conflicts::{self, Conflict};
use dataplane::nft::ruleset::Family;
use tokio::runtime::Handle;

use crate::config::{HEALTHZ_PORT, METRICS_PORT};
use crate::config::{ProxyMode, Settings};
use crate::http::health::SyncFailure;
use crate::http::service_health::ServiceHealth;
use crate::http::{self, parse_bind_address, spawn_server};
use crate::syncloop::{Observer, Shared, SyncRun};

/// The sync loop's observer: metrics, health, health-check node ports.
pub struct Telemetry {
    shared: Arc<Shared>,
    service_health: ServiceHealth,
    /// Trigger times before this are from before we started (kube-proxy ignores them too).
    started: SystemTime,
    /// The mode's failure counter: nftables sync failures here, iptables restore failures
    /// are counted by the iptables backend (it knows whether the restore was partial).
    mode: ProxyMode,
    /// The frontend conflicts of the last sync, to log each when it appears and when it ends.
    conflicts: BTreeSet<Conflict>,
}

impl Telemetry {
    /// Starts the `/metrics` and `/healthz` servers on `rt` (an empty bind address disables
    /// one) and returns the observer to hand to the sync loop.
    pub fn start(
        rt: &Handle,
        settings: &Settings,
        shared: Arc<Shared>,
    ) -> Result<Telemetry, String> {
        http::raise_fd_limit();
        let timeout = health_timeout(settings);
        let metrics_addr = parse_bind_address(&settings.metrics_bind_address, METRICS_PORT)
            .map_err(|e| format!("metricsBindAddress: {e}"))?;
        let healthz_addr = parse_bind_address(&settings.healthz_bind_address, HEALTHZ_PORT)
            .map_err(|e| format!("healthzBindAddress: {e}"))?;
        if let Some(addr) = metrics_addr {
            let mode = match settings.mode {
                ProxyMode::Nftables => "nftables",
                ProxyMode::Iptables => "iptables",
            };
            let handler = http::metrics::handler(mode, &settings.effective);
            spawn_server(
                rt,
                addr,
                handler,
                "metrics",
                settings.bind_address_hard_fail,
            )?;
        }
        if let Some(addr) = healthz_addr {
            let handler = http::health::handler(shared.health().clone(), timeout);
            spawn_server(
                rt,
                addr,
                handler,
                "healthz",
                settings.bind_address_hard_fail,
            )?;
        }
        // kube-proxy's SyncLoop start: the proxiers count as updated, a sync as queued.
        for family in Family::ALL {
            shared.health().updated(family);
        }
        metrics::metrics().queued(SystemTime::now());
        let service_health = ServiceHealth::new(rt.clone(), shared.health().clone(), timeout);
        Ok(Telemetry {
            shared,
            service_health,
            started: SystemTime::now(),
            mode: settings.mode,
            conflicts: BTreeSet::new(),
        })
    }

    /// The per-Service health-check listeners.
    pub fn service_health(&self) -> &ServiceHealth {
        &self.service_health
    }
}

impl Observer for Telemetry {
    fn synced(&mut self, run: &SyncRun<'_>) {
        let m = metrics::metrics();
        let now = SystemTime::now();
        let health = self.shared.health();
        m.set_quarantined(run.quarantined);
        for (&family, fr) in run.families {
            m.set_consecutive_failures(family, fr.failures);
            match &fr.result {
                Ok(r) => {
                    m.observe_sync(family, fr.full, r.elapsed);
                    m.sync_succeeded(family, now);
                    m.set_no_local_endpoints(family, r.no_local_endpoints);
                    m.observe_netlink(family, r.messages, r.bytes);
                    m.set_kernel_objects(family, r.objects);
                    if r.cleanup_failed {
                        m.cleanup_failed(family);
                    }
                    if r.drift_repaired {
                        m.drift_repaired(family);
                    }
                    if let Some(ipt) = r.iptables {
                        m.set_iptables_rules(
                            family,
                            "filter",
                            ipt.filter_rules,
                            ipt.filter_written,
                        );
                        m.set_iptables_rules(family, "nat", ipt.nat_rules, ipt.nat_written);
                    }
                    health.updated(family);
                    health.set_sync_failure(family, None);
                }
                Err(error) => {
                    m.observe_sync(family, fr.full, run.elapsed);
                    if self.mode == ProxyMode::Nftables {
                        m.sync_failed(family);
                    }
                    // The kernel does not hold what it should: an update is pending until a
                    // sync succeeds (kube-proxy only counts queued changes; a failing repair or
                    // periodic sync would otherwise stay "healthy" forever).
                    health.queued_update(family);
                    health.set_sync_failure(
                        family,
                        Some(SyncFailure {
                            failures: fr.failures,
                            error: error.clone(),
                            retry_at: now + fr.retry_in.unwrap_or_default(),
                        }),
                    );
                }
            }
        }
        let succeeded =
            |family: &Family| run.families.get(family).is_some_and(|fr| fr.result.is_ok());
        for &(family, t) in run.trigger_times {
            if !succeeded(&family) {
                continue;
            }
            if t < self.started {
                continue;
            }
            if let Ok(latency) = now.duration_since(t) {
                m.observe_network_programming(family, latency);
            }
        }
        if run.families.keys().any(succeeded) {
            self.service_health.sync(run.cluster, run.config);
        }
        let (has_changes, counts, invalid) = self.shared.with_tracker(|t| {
            let mut invalid: BTreeMap<(&'static str, &'static str), usize> = BTreeMap::new();
            for (kind, _, skip) in t.invalid_objects() {
                *invalid.entry((kind.name(), skip.label())).or_default() += 1;
            }
            (t.has_changes(), t.change_counts(), invalid)
        });
        // Changes that arrived during the sync are still pending.
        if has_changes {
            for family in run.families.keys().filter(|f| succeeded(f)) {
                health.queued_update(*family);
            }
        }
        m.set_changes(counts);
        m.set_invalid_objects(invalid.into_iter().map(|((k, r), n)| (k, r, n)));
        self.note_conflicts(run);
    }
}

impl Telemetry {
    /// Logs the frontend conflicts (several Services claiming one ClusterIP, or one external or
    /// load-balancer IP and port) that appeared or ended since the last sync and sets
    /// `nftproxy_frontend_conflicts`. O(conflicting addresses): the model indexes them.
    fn note_conflicts(&mut self, run: &SyncRun<'_>) {
        let now: BTreeSet<Conflict> = conflicts::conflicts(&run.cluster.services)
            .into_iter()
            .collect();
        for c in now.difference(&self.conflicts) {
            tracing::warn!(
                kind = c.kind.name(),
                frontend = %c.frontend,
                winner = %c.winner,
                losers = %names(&c.losers),
                rule = %c.rule,
                "frontend conflict: {c}"
            );
        }
        for c in self.conflicts.difference(&now) {
            tracing::info!(
                kind = c.kind.name(),
                frontend = %c.frontend,
                winner = %c.winner,
                losers = %names(&c.losers),
                "frontend conflict ended: {} {} (kept by {} against {})",
                c.kind,
                c.frontend,
                c.winner,
                names(&c.losers),
            );
        }
        metrics::metrics().set_frontend_conflicts(
            conflicts::counts(&now)
                .into_iter()
                .map(|(kind, n)| (kind.name(), n)),
        );
        self.conflicts = now;
    }
}

fn names(list: &[dataplane::model::ObjectName]) -> String {
    list.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// How long the health checks tolerate a pending update (kube-proxy: `2 × syncPeriod`).
pub fn health_timeout(settings: &Settings) -> Duration {
    2 * settings.sync_period
}
