//! Every metric nftproxy exports, defined once.
//!
//! kube-proxy's metrics keep kube-proxy's names, types, help texts (with component-base's
//! `[ALPHA] ` stability prefix), label sets and buckets as kube-proxy's nftables mode registers
//! them, so dashboards and alerts written for kube-proxy work unchanged. nftproxy's own metrics
//! are under `nftproxy_`. Like a Go component, the agent also exports client_golang's
//! `process_*` metrics ([`process`]) and client-go's `rest_client_*` metrics for its Kubernetes
//! client, so kube-prometheus's kube-proxy dashboard and alerts work unchanged.
//!
//! One process-wide registry ([`metrics`]), like Go's `legacyregistry`: any part of the agent
//! records through it, and [`encode`] writes the exposition (text format 0.0.4, byte for byte in
//! client_golang's form, see [`text`]).

pub mod process;
pub mod text;

use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dataplane::nft::build::NoLocalEndpoints;
use dataplane::nft::ruleset::{Family, Table};
use prometheus::{
    Counter, CounterVec, Gauge, GaugeVec, HistogramOpts, HistogramVec, Opts, Registry,
};

pub use text::CONTENT_TYPE;

/// `ExponentialBuckets(0.001, 2, 15)`: 1 ms to 16.384 s (kube-proxy's sync durations).
pub fn sync_buckets() -> Vec<f64> {
    exponential(0.001, 2.0, 15)
}

/// client-go's `rest_client_request_duration_seconds` buckets (component-base's
/// `restclient` metrics): 5 ms to 60 s.
pub fn rest_client_buckets() -> Vec<f64> {
    vec![
        0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
    ]
}

/// The `code` of `rest_client_requests_total` for a request that failed without a response
/// (client-go's label for every transport error).
pub const REST_CLIENT_ERROR_CODE: &str = "<error>";

/// kube-proxy's `network_programming_duration_seconds` buckets: 0.25 s, 0.5 s, 1..59 s by 1,
/// 60..115 s by 5, 120..300 s by 30 (80 buckets).
pub fn network_programming_buckets() -> Vec<f64> {
    let mut b = linear(0.25, 0.25, 2);
    b.extend(linear(1.0, 1.0, 59));
    b.extend(linear(60.0, 5.0, 12));
    b.extend(linear(120.0, 30.0, 7));
    b
}

/// Go's `prometheus.ExponentialBuckets` (same arithmetic, so the same `le` values).
fn exponential(mut start: f64, factor: f64, count: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(start);
        start *= factor;
    }
    out
}

/// Go's `prometheus.LinearBuckets`.
fn linear(mut start: f64, width: f64, count: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        out.push(start);
        start += width;
    }
    out
}

/// kube-proxy's component-base stability prefix.
fn alpha(help: &str) -> String {
    format!("[ALPHA] {help}")
}

/// Kernel objects in one family's table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjectCounts {
    pub chains: usize,
    pub rules: usize,
    pub sets: usize,
    pub set_elements: usize,
}

impl ObjectCounts {
    pub fn of(table: &Table) -> ObjectCounts {
        ObjectCounts {
            chains: table.chains.len(),
            rules: table.chains.values().map(|c| c.rules.len()).sum(),
            sets: table.sets.len(),
            set_elements: table.sets.values().map(|s| s.elements.len()).sum(),
        }
    }
}

/// All metrics. Obtain the process-wide instance with [`metrics`].
pub struct Metrics {
    registry: Registry,
    // kube-proxy (nftables mode).
    sync_duration: HistogramVec,
    sync_full_duration: HistogramVec,
    sync_partial_duration: HistogramVec,
    last_timestamp: GaugeVec,
    last_queued_timestamp: GaugeVec,
    network_programming: HistogramVec,
    endpoint_changes_pending: Gauge,
    endpoint_changes_total: Counter,
    service_changes_pending: Gauge,
    service_changes_total: Counter,
    no_local_endpoints: GaugeVec,
    nftables_sync_failures: CounterVec,
    nftables_cleanup_failures: CounterVec,
    healthz: CounterVec,
    livez: CounterVec,
    conntrack_duration: HistogramVec,
    conntrack_deleted: CounterVec,
    // kube-proxy (iptables mode).
    iptables_total: GaugeVec,
    iptables_last: GaugeVec,
    iptables_restore_failures: CounterVec,
    iptables_partial_restore_failures: CounterVec,
    // nftproxy's own.
    invalid_objects: GaugeVec,
    frontend_conflicts: GaugeVec,
    netlink_messages: HistogramVec,
    netlink_bytes: HistogramVec,
    owned_objects: GaugeVec,
    drift_repairs: CounterVec,
    consecutive_failures: GaugeVec,
    quarantined: GaugeVec,
    build_info: GaugeVec,
    // client-go's request metrics for the agent's Kubernetes client.
    rest_client_requests: CounterVec,
    rest_client_duration: HistogramVec,
    /// Serialises [`Metrics::set_changes`] (read-then-add on the change counters).
    changes: Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    buckets: Vec<f64>,
    labels: &[&str],
) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("valid histogram definition");
    r.register(Box::new(h.clone()))
        .expect("metric registered once");
    h
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid gauge definition");
    r.register(Box::new(g.clone()))
        .expect("metric registered once");
    g
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> CounterVec {
    let c = CounterVec::new(Opts::new(name, help), labels).expect("valid counter definition");
    r.register(Box::new(c.clone()))
        .expect("metric registered once");
    c
}

fn gauge(r: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::with_opts(Opts::new(name, help)).expect("valid gauge definition");
    r.register(Box::new(g.clone()))
        .expect("metric registered once");
    g
}

fn counter(r: &Registry, name: &str, help: &str) -> Counter {
    let c = Counter::with_opts(Opts::new(name, help)).expect("valid counter definition");
    r.register(Box::new(c.clone()))
        .expect("metric registered once");
    c
}

const FAMILY: &[&str] = &["ip_family"];

fn seconds_since_epoch(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Metrics {
    /// A fresh set of metrics in its own registry (tests; the agent uses [`metrics`]).
    pub fn new() -> Metrics {
        let r = Registry::new();
        let sync = "kubeproxy_sync_proxy_rules";
        let m = Metrics {
            sync_duration: histogram(
                &r,
                "kubeproxy_sync_proxy_rules_duration_seconds",
                &alpha("SyncProxyRules latency in seconds"),
                sync_buckets(),
                FAMILY,
            ),
            sync_full_duration: histogram(
                &r,
                "kubeproxy_sync_full_proxy_rules_duration_seconds",
                &alpha("SyncProxyRules latency in seconds for full resyncs"),
                sync_buckets(),
                FAMILY,
            ),
            sync_partial_duration: histogram(
                &r,
                "kubeproxy_sync_partial_proxy_rules_duration_seconds",
                &alpha("SyncProxyRules latency in seconds for partial resyncs"),
                sync_buckets(),
                FAMILY,
            ),
            last_timestamp: gauge_vec(
                &r,
                &format!("{sync}_last_timestamp_seconds"),
                &alpha("The last time proxy rules were successfully synced"),
                FAMILY,
            ),
            last_queued_timestamp: gauge_vec(
                &r,
                &format!("{sync}_last_queued_timestamp_seconds"),
                &alpha("The last time a sync of proxy rules was queued"),
                FAMILY,
            ),
            network_programming: histogram(
                &r,
                "kubeproxy_network_programming_duration_seconds",
                &alpha("In Cluster Network Programming Latency in seconds"),
                network_programming_buckets(),
                FAMILY,
            ),
            endpoint_changes_pending: gauge(
                &r,
                &format!("{sync}_endpoint_changes_pending"),
                &alpha("Pending proxy rules Endpoint changes"),
            ),
            endpoint_changes_total: counter(
                &r,
                &format!("{sync}_endpoint_changes_total"),
                &alpha("Cumulative proxy rules Endpoint changes"),
            ),
            service_changes_pending: gauge(
                &r,
                &format!("{sync}_service_changes_pending"),
                &alpha("Pending proxy rules Service changes"),
            ),
            service_changes_total: counter(
                &r,
                &format!("{sync}_service_changes_total"),
                &alpha("Cumulative proxy rules Service changes"),
            ),
            no_local_endpoints: gauge_vec(
                &r,
                &format!("{sync}_no_local_endpoints_total"),
                &alpha("Number of services with a Local traffic policy and no endpoints"),
                &["traffic_policy", "ip_family"],
            ),
            nftables_sync_failures: counter_vec(
                &r,
                &format!("{sync}_nftables_sync_failures_total"),
                &alpha("Cumulative proxy nftables sync failures"),
                FAMILY,
            ),
            nftables_cleanup_failures: counter_vec(
                &r,
                &format!("{sync}_nftables_cleanup_failures_total"),
                &alpha("Cumulative proxy nftables cleanup failures"),
                FAMILY,
            ),
            healthz: counter_vec(
                &r,
                "kubeproxy_proxy_healthz_total",
                &alpha("Cumulative proxy healthz HTTP status"),
                &["code"],
            ),
            livez: counter_vec(
                &r,
                "kubeproxy_proxy_livez_total",
                &alpha("Cumulative proxy livez HTTP status"),
                &["code"],
            ),
            conntrack_duration: histogram(
                &r,
                "kubeproxy_conntrack_reconciler_sync_duration_seconds",
                &alpha("ReconcileConntrackFlowsLatency latency in seconds"),
                sync_buckets(),
                FAMILY,
            ),
            conntrack_deleted: counter_vec(
                &r,
                "kubeproxy_conntrack_reconciler_deleted_entries_total",
                &alpha("Cumulative conntrack flows deleted by conntrack reconciler"),
                FAMILY,
            ),
            iptables_total: gauge_vec(
                &r,
                &format!("{sync}_iptables_total"),
                &alpha("Total number of iptables rules owned by kube-proxy"),
                &["table", "ip_family"],
            ),
            iptables_last: gauge_vec(
                &r,
                &format!("{sync}_iptables_last"),
                &alpha("Number of iptables rules written by kube-proxy in last sync"),
                &["table", "ip_family"],
            ),
            iptables_restore_failures: counter_vec(
                &r,
                &format!("{sync}_iptables_restore_failures_total"),
                &alpha("Cumulative proxy iptables restore failures"),
                FAMILY,
            ),
            iptables_partial_restore_failures: counter_vec(
                &r,
                &format!("{sync}_iptables_partial_restore_failures_total"),
                &alpha("Cumulative proxy iptables partial restore failures"),
                FAMILY,
            ),
            invalid_objects: gauge_vec(
                &r,
                "nftproxy_invalid_objects",
                "Kubernetes objects currently skipped because they are invalid, by kind and reason",
                &["kind", "reason"],
            ),
            frontend_conflicts: gauge_vec(
                &r,
                "nftproxy_frontend_conflicts",
                "Frontends claimed by more than one Service right now, by how the losers claimed \
                 them (cluster-ip, external-ip, load-balancer-ip, node-port); only the winner's claim is \
                 programmed",
                &["kind"],
            ),
            netlink_messages: histogram(
                &r,
                "nftproxy_sync_netlink_messages",
                "Netlink messages sent to nf_tables per sync (batch begin and end included)",
                exponential(1.0, 4.0, 10),
                FAMILY,
            ),
            netlink_bytes: histogram(
                &r,
                "nftproxy_sync_netlink_bytes",
                "Netlink bytes sent to nf_tables per sync",
                exponential(256.0, 4.0, 10),
                FAMILY,
            ),
            owned_objects: gauge_vec(
                &r,
                "nftproxy_kernel_objects",
                "Objects in nftproxy's nftables table after the last successful sync, by type \
                 (chains, rules, sets, set_elements)",
                &["ip_family", "type"],
            ),
            drift_repairs: counter_vec(
                &r,
                "nftproxy_drift_repairs_total",
                "Full syncs that found nftproxy's table changed by someone else and repaired it",
                FAMILY,
            ),
            consecutive_failures: gauge_vec(
                &r,
                "nftproxy_sync_consecutive_failures",
                "Syncs of the family that failed in a row (0 once one succeeds); a failing \
                 family is retried with exponential backoff up to syncPeriod",
                FAMILY,
            ),
            quarantined: gauge_vec(
                &r,
                "nftproxy_quarantined_services",
                "Services kept out of the rules because the kernel refused them (each is tried \
                 again later)",
                &[],
            ),
            build_info: gauge_vec(
                &r,
                "nftproxy_build_info",
                "A metric with a constant '1' value labeled by the nftproxy version",
                &["version"],
            ),
            rest_client_requests: counter_vec(
                &r,
                "rest_client_requests_total",
                &alpha("Number of HTTP requests, partitioned by status code, method, and host."),
                &["code", "method", "host"],
            ),
            rest_client_duration: histogram(
                &r,
                "rest_client_request_duration_seconds",
                &alpha("Request latency in seconds. Broken down by verb, and host."),
                rest_client_buckets(),
                &["verb", "host"],
            ),
            registry: r,
            changes: Mutex::new(()),
        };
        m.registry
            .register(Box::new(process::ProcessCollector::new()))
            .expect("process metrics registered once");
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1.0);
        m
    }

    /// The names of every metric family this set defines, whether or not it has samples yet
    /// (for checking dashboards and alerts against what the agent exports).
    pub fn family_names(&self) -> Vec<String> {
        let process = process::ProcessCollector::new();
        let collectors: [&dyn prometheus::core::Collector; 33] = [
            &self.sync_duration,
            &self.sync_full_duration,
            &self.sync_partial_duration,
            &self.last_timestamp,
            &self.last_queued_timestamp,
            &self.network_programming,
            &self.endpoint_changes_pending,
            &self.endpoint_changes_total,
            &self.service_changes_pending,
            &self.service_changes_total,
            &self.no_local_endpoints,
            &self.nftables_sync_failures,
            &self.nftables_cleanup_failures,
            &self.healthz,
            &self.livez,
            &self.conntrack_duration,
            &self.conntrack_deleted,
            &self.iptables_total,
            &self.iptables_last,
            &self.iptables_restore_failures,
            &self.iptables_partial_restore_failures,
            &self.invalid_objects,
            &self.frontend_conflicts,
            &self.netlink_messages,
            &self.netlink_bytes,
            &self.owned_objects,
            &self.drift_repairs,
            &self.consecutive_failures,
            &self.quarantined,
            &self.build_info,
            &self.rest_client_requests,
            &self.rest_client_duration,
            &process,
        ];
        let mut names: Vec<String> = collectors
            .iter()
            .flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone()))
            .collect();
        names.sort();
        names
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> String {
        text::encode(&self.registry.gather())
    }

    /// A sync attempt of `family` ended, successfully or not (kube-proxy's deferred
    /// observation in `syncProxyRules`).
    pub fn observe_sync(&self, family: Family, full: bool, elapsed: Duration) {
        let l = [family.k8s_name()];
        let s = elapsed.as_secs_f64();
        self.sync_duration.with_label_values(&l).observe(s);
        let which = if full {
            &self.sync_full_duration
        } else {
            &self.sync_partial_duration
        };
        which.with_label_values(&l).observe(s);
    }

    /// `family` was synced successfully at `now`.
    pub fn sync_succeeded(&self, family: Family, now: SystemTime) {
        self.last_timestamp
            .with_label_values(&[family.k8s_name()])
            .set(seconds_since_epoch(now));
    }

    /// The main transaction of `family` failed.
    pub fn sync_failed(&self, family: Family) {
        self.nftables_sync_failures
            .with_label_values(&[family.k8s_name()])
            .inc();
    }

    /// iptables mode: the rules in nftproxy's chains of `table` (`filter`, `nat`) after a
    /// successful sync, and how many the sync's restore wrote.
    pub fn set_iptables_rules(&self, family: Family, table: &str, total: usize, written: usize) {
        let l = [table, family.k8s_name()];
        self.iptables_total.with_label_values(&l).set(total as f64);
        self.iptables_last.with_label_values(&l).set(written as f64);
    }

    /// iptables mode: an `iptables-restore` of `family` failed; `partial` if it was a partial
    /// restore (the next one is full).
    pub fn iptables_restore_failed(&self, family: Family, partial: bool) {
        let l = [family.k8s_name()];
        self.iptables_restore_failures.with_label_values(&l).inc();
        if partial {
            self.iptables_partial_restore_failures
                .with_label_values(&l)
                .inc();
        }
    }

    /// The stale-chain cleanup transaction of `family` failed.
    pub fn cleanup_failed(&self, family: Family) {
        self.nftables_cleanup_failures
            .with_label_values(&[family.k8s_name()])
            .inc();
    }

    /// A sync was queued at `now` (kube-proxy's `Sync()`; also at startup).
    pub fn queued(&self, now: SystemTime) {
        for family in Family::ALL {
            self.last_queued_timestamp
                .with_label_values(&[family.k8s_name()])
                .set(seconds_since_epoch(now));
        }
    }

    /// The per-sync recount of Services with a Local policy and no local endpoint.
    pub fn set_no_local_endpoints(&self, family: Family, counts: NoLocalEndpoints) {
        for (policy, n) in [("internal", counts.internal), ("external", counts.external)] {
            self.no_local_endpoints
                .with_label_values(&[policy, family.k8s_name()])
                .set(n as f64);
        }
    }

    /// One EndpointSlice change was programmed `latency` after its trigger time.
    pub fn observe_network_programming(&self, family: Family, latency: Duration) {
        self.network_programming
            .with_label_values(&[family.k8s_name()])
            .observe(latency.as_secs_f64());
    }

    /// Brings the change counters up to the tracker's totals and sets the pending gauges.
    pub fn set_changes(&self, counts: dataplane::tracker::ChangeCounts) {
        let _serial = self.changes.lock().unwrap_or_else(PoisonError::into_inner);
        let add = |c: &Counter, total: u64| {
            let now = c.get();
            if (total as f64) > now {
                c.inc_by(total as f64 - now);
            }
        };
        add(&self.service_changes_total, counts.service_events);
        add(&self.endpoint_changes_total, counts.slice_events);
        self.service_changes_pending
            .set(counts.services_pending as f64);
        self.endpoint_changes_pending
            .set(counts.endpoints_pending as f64);
    }

    /// A `/healthz` answer.
    pub fn healthz(&self, code: u16) {
        self.healthz.with_label_values(&[&code.to_string()]).inc();
    }

    /// A `/livez` answer.
    pub fn livez(&self, code: u16) {
        self.livez.with_label_values(&[&code.to_string()]).inc();
    }

    /// One conntrack reconcile of `family`: how long it took and how many entries it deleted.
    pub fn observe_conntrack(&self, family: Family, elapsed: Duration, deleted: u64) {
        let l = [family.k8s_name()];
        self.conntrack_duration
            .with_label_values(&l)
            .observe(elapsed.as_secs_f64());
        self.conntrack_deleted
            .with_label_values(&l)
            .inc_by(deleted as f64);
    }

    /// Replaces the invalid-object gauges: `(kind, reason, count)`.
    pub fn set_invalid_objects<'a>(
        &self,
        counts: impl IntoIterator<Item = (&'a str, &'a str, usize)>,
    ) {
        self.invalid_objects.reset();
        for (kind, reason, n) in counts {
            self.invalid_objects
                .with_label_values(&[kind, reason])
                .add(n as f64);
        }
    }

    /// Sets the frontend-conflict gauges: `(kind, number of conflicting frontends)`.
    pub fn set_frontend_conflicts<'a>(&self, counts: impl IntoIterator<Item = (&'a str, usize)>) {
        for (kind, n) in counts {
            self.frontend_conflicts
                .with_label_values(&[kind])
                .set(n as f64);
        }
    }

    /// What one family's sync sent over netlink.
    pub fn observe_netlink(&self, family: Family, messages: usize, bytes: usize) {
        let l = [family.k8s_name()];
        self.netlink_messages
            .with_label_values(&l)
            .observe(messages as f64);
        self.netlink_bytes
            .with_label_values(&l)
            .observe(bytes as f64);
    }

    /// The objects of `family`'s table after a successful sync.
    pub fn set_kernel_objects(&self, family: Family, counts: ObjectCounts) {
        for (kind, n) in [
            ("chains", counts.chains),
            ("rules", counts.rules),
            ("sets", counts.sets),
            ("set_elements", counts.set_elements),
        ] {
            self.owned_objects
                .with_label_values(&[family.k8s_name(), kind])
                .set(n as f64);
        }
    }

    /// How many syncs of `family` failed in a row (0 after a success).
    pub fn set_consecutive_failures(&self, family: Family, failures: u32) {
        self.consecutive_failures
            .with_label_values(&[family.k8s_name()])
            .set(f64::from(failures));
    }

    /// How many Services are kept out of the rules because the kernel refused them.
    pub fn set_quarantined(&self, services: usize) {
        self.quarantined
            .with_label_values::<&str>(&[])
            .set(services as f64);
    }

    /// A full sync of `family` repaired changes someone else made to the table.
    pub fn drift_repaired(&self, family: Family) {
        self.drift_repairs
            .with_label_values(&[family.k8s_name()])
            .inc();
    }

    /// One request of the Kubernetes client got its final answer: `code` is the HTTP status
    /// (`"200"`) or [`REST_CLIENT_ERROR_CODE`] when it failed without a response; `method` the
    /// HTTP method (`"GET"`); `host` the API server's `host:port` as in the client's URL.
    pub fn rest_client_request(&self, code: &str, method: &str, host: &str) {
        self.rest_client_requests
            .with_label_values(&[code, method, host])
            .inc();
    }

    /// One request of the Kubernetes client took `elapsed` (client-go observes every request
    /// but watches and streams, from the call to the end of the response body).
    pub fn observe_rest_client_duration(&self, verb: &str, host: &str, elapsed: Duration) {
        self.rest_client_duration
            .with_label_values(&[verb, host])
            .observe(elapsed.as_secs_f64());
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

static METRICS: OnceLock<Metrics> = OnceLock::new();

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    METRICS.get_or_init(Metrics::new)
}

/// The process-wide exposition (`/metrics`).
pub fn encode() -> String {
    metrics().encode()
}

/// For the conntrack reconciler: one reconcile of `family` took `elapsed` and deleted `deleted`
/// entries (kube-proxy observes both also when the deletion failed part-way).
pub fn observe_conntrack(family: Family, elapsed: Duration, deleted: u64) {
    metrics().observe_conntrack(family, elapsed, deleted);
}

#[cfg(test)]
mod tests;
