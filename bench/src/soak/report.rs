//! The report: statistics of the samples, the targets the run is held to, and the text output.

use super::*;

pub(super) fn progress(message: &str) {
    eprintln!("nftproxy-soak: {message}");
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The samples from the warm-up on: extremes, ends, and the medians of the first minute after
/// the warm-up and of the final minute.
pub(super) fn series_stats(
    samples: &[Sample],
    warmup_s: f64,
    end_s: f64,
    value: &dyn Fn(&Sample) -> f64,
) -> SeriesStats {
    let post: Vec<&Sample> = samples.iter().filter(|s| s.t_s >= warmup_s).collect();
    let post = if post.is_empty() {
        samples.iter().collect()
    } else {
        post
    };
    let Some((first, last)) = post.first().zip(post.last()) else {
        return SeriesStats::default();
    };
    let values: Vec<f64> = post.iter().map(|s| value(s)).collect();
    let window = |from: f64, to: f64| -> f64 {
        median(
            post.iter()
                .filter(|s| s.t_s >= from - 1e-6 && s.t_s <= to + 1e-6)
                .map(|s| value(s))
                .collect(),
        )
    };
    let first_m = window(first.t_s, first.t_s + WINDOW_S);
    let last_m = window(end_s - WINDOW_S, end_s);
    SeriesStats {
        samples: post.len(),
        min: values.iter().copied().fold(f64::INFINITY, f64::min),
        max: values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        first: value(first),
        last: value(last),
        first_minute_median: first_m,
        last_minute_median: last_m,
        growth: last_m - first_m,
        growth_pct: (last_m / first_m - 1.0) * 100.0,
    }
}

pub(super) fn agent_metrics(before: &Metrics, after: &Metrics) -> AgentMetrics {
    let delta = |name: &str| after.sum(name, &[]) - before.sum(name, &[]);
    let np = "kubeproxy_network_programming_duration_seconds";
    let messages = HistogramIncrease::between(before, after, "nftproxy_sync_netlink_messages");
    AgentMetrics {
        sync_duration: HistogramIncrease::between(
            before,
            after,
            "kubeproxy_sync_proxy_rules_duration_seconds",
        ),
        ipv4_syncs: after.sum(
            "kubeproxy_sync_proxy_rules_duration_seconds_count",
            &["ip_family=\"IPv4\""],
        ) - before.sum(
            "kubeproxy_sync_proxy_rules_duration_seconds_count",
            &["ip_family=\"IPv4\""],
        ),
        endpoint_changes: delta("kubeproxy_sync_proxy_rules_endpoint_changes_total"),
        full_syncs: delta("kubeproxy_sync_full_proxy_rules_duration_seconds_count"),
        partial_syncs: delta("kubeproxy_sync_partial_proxy_rules_duration_seconds_count"),
        network_programming: after
            .has(&format!("{np}_count"))
            .then(|| HistogramIncrease::between(before, after, np)),
        syncs_total: after.sum("kubeproxy_sync_proxy_rules_duration_seconds_count", &[]),
        sync_seconds_total: after.sum("kubeproxy_sync_proxy_rules_duration_seconds_sum", &[]),
        sync_failures_total: after.sum(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
            &[],
        ),
        drift_repairs_total: after.sum("nftproxy_drift_repairs_total", &[]),
        endpoint_changes_total: after.sum("kubeproxy_sync_proxy_rules_endpoint_changes_total", &[]),
        quarantined_services: after.sum("nftproxy_quarantined_services", &[]),
        process_open_fds: after.sum("process_open_fds", &[]),
        process_resident_memory_mib: after.sum("process_resident_memory_bytes", &[])
            / (1024.0 * 1024.0),
        netlink_messages_per_sync: (messages.count > 0.0)
            .then(|| messages.sum_seconds / messages.count),
    }
}

pub(super) fn targets(r: &Report) -> Vec<Target> {
    let mut out = Vec::new();
    out.push(Target {
        target: "agent RSS growth <= 10% (final minute vs first minute after the warm-up, medians)"
            .into(),
        measured: format!(
            "{:.1} -> {:.1} MiB ({:+.1}%)",
            r.rss_mib.first_minute_median, r.rss_mib.last_minute_median, r.rss_mib.growth_pct
        ),
        pass: r.rss_mib.growth_pct <= 10.0,
    });
    out.push(Target {
        target: "agent open fds flat (<= +5, same medians)".into(),
        measured: format!(
            "{:.0} -> {:.0} ({:+.0}; min {:.0}, max {:.0})",
            r.fds.first_minute_median, r.fds.last_minute_median, r.fds.growth, r.fds.min, r.fds.max
        ),
        pass: r.fds.growth <= 5.0,
    });
    let pending = r.check.pending_ops();
    let later = r
        .rechecks
        .iter()
        .find(|c| c.pending_ops() == 0)
        .map_or(String::new(), |c| {
            format!("; equal {:.1} s after the churn", c.at_s)
        });
    out.push(Target {
        target: format!(
            "0 lost changes: kernel == model {:.0} s after the churn (plan ops, both families)",
            r.check.at_s
        ),
        measured: format!(
            "{pending} ops for {} changes written, {} API errors{later}",
            r.changes_written, r.api_errors
        ),
        pass: pending == 0 && r.api_errors == 0 && r.check.control_ops > 0,
    });
    out
}

// ---------------------------------------------------------------------------------------------
// Output

pub(super) fn f(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v.abs() < 10.0 {
        format!("{v:.2}")
    } else if v.abs() < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

pub(super) fn opt_ms(v: Option<f64>) -> String {
    v.map_or("-".into(), f)
}

pub(super) fn render(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "nftproxy-soak: {} Services x {} endpoints (one EndpointSlice each), pod pool {}, \
         churn {}/s for {} s, minSyncPeriod {}, syncPeriod {}",
        r.services,
        r.endpoints_per_service,
        r.pod_ips,
        r.rate_target,
        r.duration_s,
        r.min_sync_period,
        r.sync_period
    );
    let _ = writeln!(
        o,
        "{}; kernel {}; {} CPUs; seed {}\ncommand: {}\n",
        r.date, r.kernel, r.cpus, r.seed, r.command
    );
    let _ = writeln!(o, "Setup");
    let _ = writeln!(
        o,
        "  objects loaded into the API server      {:.1} s",
        r.load_s
    );
    let _ = writeln!(
        o,
        "  agent started -> both families synced   {:.1} s",
        r.first_sync_s
    );
    let _ = writeln!(o, "Churn");
    let _ = writeln!(
        o,
        "  EndpointSlice changes written           {} in {:.1} s = {:.2}/s (target {}/s); {} API errors; writer at most {:.0} ms behind",
        r.changes_written,
        r.churn_s,
        r.changes_per_s,
        r.rate_target,
        r.api_errors,
        r.max_writer_lag_ms
    );
    let _ = writeln!(
        o,
        "  agent CPU during the churn              {:.1} s ({:.1}% of one CPU)",
        r.churn_cpu_s, r.churn_cpu_pct
    );
    let _ = writeln!(
        o,
        "  agent's API requests (churn and check)  {} lists, {} watches, {} not 200; {} history compactions",
        r.api_lists, r.api_watches, r.api_failed, r.compactions
    );
    let _ = writeln!(
        o,
        "Agent process, sampled every {} s; judged after a {} s warm-up ({} samples)",
        r.sample_every_s, r.warmup_s, r.rss_mib.samples
    );
    let _ = writeln!(
        o,
        "  {:<10} {:>8} {:>8} {:>8} {:>8} {:>14} {:>14} {:>10}",
        "", "min", "max", "first", "last", "first-min med", "last-min med", "growth"
    );
    for (name, s, pct) in [
        ("RSS, MiB", &r.rss_mib, true),
        ("open fds", &r.fds, false),
        ("threads", &r.threads, false),
    ] {
        let growth = if pct {
            format!("{:+.1}%", s.growth_pct)
        } else {
            format!("{:+.0}", s.growth)
        };
        let _ = writeln!(
            o,
            "  {:<10} {:>8} {:>8} {:>8} {:>8} {:>14} {:>14} {:>10}",
            name,
            f(s.min),
            f(s.max),
            f(s.first),
            f(s.last),
            f(s.first_minute_median),
            f(s.last_minute_median),
            growth
        );
    }
    let _ = writeln!(
        o,
        "Agent's /metrics (churn and settle period, both families)"
    );
    match (&r.metrics, &r.metrics_error) {
        (Some(m), _) => {
            let s = &m.sync_duration;
            let _ = writeln!(
                o,
                "  family syncs                            {:.0} ({:.0} IPv4; {:.0} partial, {:.0} full); {:.0} since start, {:.0} failed; {:.0} drift repairs; {:.0} quarantined Services",
                s.count,
                m.ipv4_syncs,
                m.partial_syncs,
                m.full_syncs,
                m.syncs_total,
                m.sync_failures_total,
                m.drift_repairs_total,
                m.quarantined_services
            );
            let _ = writeln!(
                o,
                "  sync duration, ms                       mean {} (sum {:.2} s / count {:.0}), p50 {}, p99 {}",
                opt_ms(s.mean_ms),
                s.sum_seconds,
                s.count,
                opt_ms(s.p50_ms),
                opt_ms(s.p99_ms)
            );
            let _ = writeln!(
                o,
                "  netlink messages per sync               {}",
                opt_ms(m.netlink_messages_per_sync)
            );
            match &m.network_programming {
                Some(np) => {
                    let _ = writeln!(
                        o,
                        "  network programming latency, ms         mean {}, p50 {}, p99 {} ({:.0} observations)",
                        opt_ms(np.mean_ms),
                        opt_ms(np.p50_ms),
                        opt_ms(np.p99_ms),
                        np.count
                    );
                }
                None => {
                    let _ = writeln!(o, "  network programming latency             not exported");
                }
            }
            let _ = writeln!(
                o,
                "  endpoint changes counted                {:.0} ({:.0} since start); process_open_fds {:.0}, process_resident_memory {:.1} MiB",
                m.endpoint_changes,
                m.endpoint_changes_total,
                m.process_open_fds,
                m.process_resident_memory_mib
            );
        }
        (None, e) => {
            let _ = writeln!(o, "  not scraped: {}", e.as_deref().unwrap_or("?"));
        }
    }
    let _ = writeln!(
        o,
        "  agent log: {} warnings, {} errors",
        r.agent_warnings, r.agent_errors
    );
    for w in r.agent_first_warnings.iter().take(5) {
        let _ = writeln!(o, "    {w}");
    }
    for c in std::iter::once(&r.check).chain(&r.rechecks) {
        let _ = writeln!(
            o,
            "Kernel vs the API server's objects, {:.1} s after the churn ({} Services, {} slices, {} endpoints; check took {:.0} ms)",
            c.at_s, c.services, c.slices, c.endpoints, c.took_ms
        );
        for fc in &c.families {
            let _ = writeln!(
                o,
                "  {}: {}, {} chains, {} sets, {} elements (model {}); plan {} ops, cleanup {} ops",
                fc.family,
                if fc.kernel_table {
                    "table present"
                } else {
                    "NO TABLE"
                },
                fc.kernel_chains,
                fc.kernel_sets,
                fc.kernel_elements,
                fc.desired_elements,
                fc.ops,
                fc.cleanup_ops
            );
            for op in &fc.first_ops {
                let _ = writeln!(o, "    {op}");
            }
        }
        let _ = writeln!(
            o,
            "  control (one endpoint moved in the model only): plan {} ops{}",
            c.control_ops,
            if c.control_ops > 0 {
                ""
            } else {
                " -- THE CHECK IS BLIND"
            }
        );
    }
    let _ = writeln!(
        o,
        "(soak process RSS at the end: {:.0} MiB; the test API server keeps every change)",
        r.soak_rss_mib
    );
    let _ = writeln!(o, "\nTargets");
    for t in &r.targets {
        let _ = writeln!(
            o,
            "  {}  {}: {}",
            if t.pass { "PASS" } else { "FAIL" },
            t.target,
            t.measured
        );
    }
    o
}
