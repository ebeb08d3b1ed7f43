//! `nftproxy-soak`: a long run of the real agent (`nftproxy run --kubeconfig`) against the
//! in-repo test API server while EndpointSlices churn, watching the agent's memory and file
//! descriptors, and checking at the end that the kernel holds exactly what the final objects
//! ask for. See docs/performance.md ("Soak").
//!
//! Needs root. Everything happens in one network namespace `nftpb-<pid>-soak` (loopback only),
//! deleted at the end, on failure and on Ctrl-C/SIGTERM, with the agent killed by PID.

mod agent;
mod check;
#[allow(dead_code)] // Shared with nftproxy-bench, which uses more of it.
#[path = "../netns.rs"]
mod netns;
mod objects;
mod probe;
mod report;

use self::report::*;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use nftproxy_tests::apiserver::ApiServer;
use serde::Serialize;

use crate::agent::{Agent, agent_binary, go_duration};
use crate::check::Check;
use crate::netns::Netns;
use crate::objects::Rng;
use crate::probe::{HistogramIncrease, Metrics};

#[derive(Parser, Debug)]
#[command(
    name = "nftproxy-soak",
    about = "Soak run: the real agent against the test API server under EndpointSlice churn; \
             RSS and fd growth, and an exact kernel-vs-model check at the end"
)]
struct Cli {
    /// Services (ClusterIP, one TCP port), each with one EndpointSlice.
    #[arg(long, default_value_t = 10_000)]
    services: usize,
    /// Endpoints per EndpointSlice (also after every change).
    #[arg(long, default_value_t = 5)]
    endpoints: usize,
    /// Size of the pod IP pool the endpoints are drawn from (10.64.0.0 + n).
    #[arg(long, default_value_t = 65_536)]
    pod_ips: usize,
    /// How long the churn runs (Go syntax: 30m, 90s, 1h).
    #[arg(long, default_value = "30m", value_parser = go_duration)]
    duration: Duration,
    /// EndpointSlice changes per second.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// The agent's nftables.minSyncPeriod.
    #[arg(long, default_value = "1s")]
    min_sync_period: String,
    /// The agent's nftables.syncPeriod (its longest retry backoff; full syncs are hourly).
    #[arg(long, default_value = "30s")]
    sync_period: String,
    /// Interval of the RSS and fd samples.
    #[arg(long, default_value = "10s", value_parser = go_duration)]
    sample_every: Duration,
    /// Samples before this are not judged [default: 2m, or 10% of a shorter run].
    #[arg(long, value_parser = go_duration)]
    warmup: Option<Duration>,
    /// How long after the last change the kernel is compared with the objects.
    #[arg(long, default_value = "5s", value_parser = go_duration)]
    settle: Duration,
    /// Forget the API server's change history this often (0: never). The test API server
    /// keeps every change (about 12 KiB each); compacting bounds that for long runs, but a
    /// watch that reconnects from before a compaction gets 410 Gone and re-lists (counted).
    #[arg(long, default_value = "0s", value_parser = go_duration)]
    compact_every: Duration,
    /// Seed of the churn's random choices [default: from the clock].
    #[arg(long)]
    seed: Option<u64>,
    /// The nftproxy binary [default: next to this one].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Also write the agent's log (stderr) to this file.
    #[arg(long)]
    agent_log: Option<PathBuf>,
    /// Also write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Where the agent serves `/metrics` inside the namespace (kube-proxy's default).
const METRICS: &str = "127.0.0.1:10249";
/// Seconds of each end window whose median is compared.
const WINDOW_S: f64 = 60.0;

fn main() {
    match real_main() {
        Ok(pass) => std::process::exit(if pass { 0 } else { 1 }),
        Err(e) => {
            eprintln!("nftproxy-soak: {e:#}");
            netns::cleanup_all();
            std::process::exit(2);
        }
    }
}

fn real_main() -> Result<bool> {
    let cli = Cli::parse();
    // SAFETY: geteuid has no memory effects.
    if unsafe { libc::geteuid() } != 0 {
        bail!("needs root (network namespaces and nf_tables)");
    }
    ensure!(
        (1..=objects::MAX_SERVICES).contains(&cli.services),
        "--services: 1 to {}",
        objects::MAX_SERVICES
    );
    ensure!(cli.endpoints >= 1, "--endpoints must be at least 1");
    ensure!(
        (cli.endpoints..=objects::MAX_POD_IPS).contains(&cli.pod_ips),
        "--pod-ips: from --endpoints to {}",
        objects::MAX_POD_IPS
    );
    ensure!(
        cli.rate > 0.0 && cli.rate <= 10_000.0,
        "--rate: above 0, at most 10000"
    );
    ensure!(
        !cli.sample_every.is_zero(),
        "--sample-every must be positive"
    );
    for (flag, v) in [
        ("--min-sync-period", &cli.min_sync_period),
        ("--sync-period", &cli.sync_period),
    ] {
        go_duration(v).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    }
    let agent_bin = agent_binary(cli.agent.as_deref())?;
    netns::install_signal_handler()?;
    netns::remove_stale();
    let report = soak(&cli, &agent_bin)?;
    print!("{}", render(&report));
    if let Some(path) = &cli.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| path.display().to_string())?;
    }
    Ok(report.targets.iter().all(|t| t.pass))
}

// ---------------------------------------------------------------------------------------------
// The run

#[derive(Clone, Debug, Serialize)]
struct Sample {
    /// Seconds since the churn started.
    t_s: f64,
    rss_kib: u64,
    fds: usize,
    threads: usize,
    /// Changes written so far.
    changes: u64,
    /// The agent's CPU time so far (user + system, all threads), s.
    cpu_s: f64,
    /// This process's RSS (mostly the test API server's objects and change history), KiB.
    soak_rss_kib: u64,
    /// Set elements of both tables as the agent last committed them
    /// (`nftproxy_kernel_objects`), if its /metrics answered.
    elements: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize)]
struct SeriesStats {
    samples: usize,
    min: f64,
    max: f64,
    first: f64,
    last: f64,
    /// Median of the samples in the first minute after the warm-up.
    first_minute_median: f64,
    /// Median of the samples in the final minute.
    last_minute_median: f64,
    /// last_minute_median - first_minute_median.
    growth: f64,
    growth_pct: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
struct AgentMetrics {
    /// Syncs (both families) during the churn and the settle period, from
    /// `kubeproxy_sync_proxy_rules_duration_seconds`.
    sync_duration: HistogramIncrease,
    /// Of those, IPv4 syncs (the rest are IPv6).
    ipv4_syncs: f64,
    full_syncs: f64,
    partial_syncs: f64,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_total` over the same window: the
    /// EndpointSlice events the agent's tracker counted.
    endpoint_changes: f64,
    /// `kubeproxy_network_programming_duration_seconds` over the same window (`None`: the
    /// agent does not export it).
    network_programming: Option<HistogramIncrease>,
    /// Whole run (since the agent started).
    syncs_total: f64,
    sync_seconds_total: f64,
    sync_failures_total: f64,
    drift_repairs_total: f64,
    endpoint_changes_total: f64,
    quarantined_services: f64,
    process_open_fds: f64,
    process_resident_memory_mib: f64,
    netlink_messages_per_sync: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
struct Target {
    target: String,
    measured: String,
    pass: bool,
}

#[derive(Clone, Debug, Serialize)]
struct Report {
    command: String,
    date: String,
    kernel: String,
    cpus: usize,
    seed: u64,
    services: usize,
    endpoints_per_service: usize,
    pod_ips: usize,
    rate_target: f64,
    duration_s: f64,
    min_sync_period: String,
    sync_period: String,
    sample_every_s: f64,
    warmup_s: f64,
    /// Applying the initial objects to the API server, s.
    load_s: f64,
    /// From the agent's start until both families were committed, s.
    first_sync_s: f64,
    changes_written: u64,
    churn_s: f64,
    changes_per_s: f64,
    api_errors: u64,
    /// How far the writer fell behind its schedule at worst, ms.
    max_writer_lag_ms: f64,
    /// The agent's CPU over the churn, s, and as a share of one CPU, %.
    churn_cpu_s: f64,
    churn_cpu_pct: f64,
    samples: Vec<Sample>,
    rss_mib: SeriesStats,
    fds: SeriesStats,
    threads: SeriesStats,
    metrics: Option<AgentMetrics>,
    metrics_error: Option<String>,
    check: Check,
    /// Later checks, when the first one found differences.
    rechecks: Vec<Check>,
    agent_warnings: usize,
    agent_errors: usize,
    agent_first_warnings: Vec<String>,
    /// History compactions of the test API server during the churn (`--compact-every`).
    compactions: u64,
    /// Requests the agent made to the API server from the start of the churn to the end of the
    /// check: lists (a re-list follows a 410 Gone or a failed watch) and watches (a watch
    /// ends with its timeout and is resumed).
    api_lists: usize,
    api_watches: usize,
    /// Of those, answered with a status other than 200.
    api_failed: usize,
    /// The soak process's own RSS at the end (the test API server keeps every change), MiB.
    soak_rss_mib: f64,
    targets: Vec<Target>,
}

fn warmup(cli: &Cli) -> Duration {
    cli.warmup
        .unwrap_or_else(|| Duration::from_secs(120).min(cli.duration / 10))
}

fn soak(cli: &Cli, agent_bin: &Path) -> Result<Report> {
    let seed = cli.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let mut rng = Rng::new(seed);
    let dir = netns::TempDir::new()?;
    let config_text = objects::kube_proxy_config(&cli.min_sync_period, &cli.sync_period);
    let config_file = dir.path().join("kube-proxy-config.yaml");
    std::fs::write(&config_file, &config_text)?;
    check::settings(&config_text).context("the agent configuration")?;

    let ns = Netns::create("soak")?;
    let api = ApiServer::start_in_netns(ns.name())?;
    if let Some(d) = api.kubeconfig().parent() {
        netns::register_temp_dir(d.to_path_buf());
    }
    let load = Instant::now();
    api.apply(nftproxy_tests::cluster::node(
        objects::NODE,
        &[objects::NODE_IP],
        &[],
    ))?;
    for i in 0..cli.services {
        api.apply(objects::service(i))?;
        let pods = objects::initial_pods(i, cli.endpoints, cli.pod_ips);
        api.apply(objects::slice(i, &pods, None))?;
    }
    let load_s = load.elapsed().as_secs_f64();
    progress(&format!(
        "{} Services and EndpointSlices loaded into the API server in {load_s:.1} s; starting the agent",
        cli.services
    ));

    let mut agent = Agent::start(
        &ns,
        agent_bin,
        &api.kubeconfig(),
        &config_file,
        cli.agent_log.as_deref(),
    )?;
    // One commit per family.
    agent.wait_commits(2, Duration::from_secs(600))?;
    let first_sync_s = agent.started.elapsed().as_secs_f64();
    progress(&format!(
        "first sync after {first_sync_s:.1} s; churning {}/s for {:?}",
        cli.rate, cli.duration
    ));
    std::thread::sleep(Duration::from_secs(2));
    let metrics_addr: SocketAddr = METRICS.parse().expect("valid address");
    let metrics_before = probe::scrape(&ns, metrics_addr);

    // The churn, with a sample of the agent every `sample_every`.
    let pid = agent.pid;
    let sample = |t: Duration, changes: u64| -> Result<Sample> {
        Ok(Sample {
            t_s: t.as_secs_f64(),
            rss_kib: probe::rss_kib(pid)?,
            fds: probe::fd_count(pid)?,
            threads: probe::threads(pid)?,
            changes,
            cpu_s: probe::cpu_seconds(pid)?,
            soak_rss_kib: probe::rss_kib(std::process::id())?,
            elements: probe::scrape(&ns, metrics_addr)
                .ok()
                .map(|m| m.sum("nftproxy_kernel_objects", &["type=\"set_elements\""])),
        })
    };
    let mut samples = Vec::new();
    let start = Instant::now();
    let end = start + cli.duration;
    let (mut written, mut api_errors) = (0u64, 0u64);
    let mut max_lag = Duration::ZERO;
    let mut next_write = start;
    let mut next_sample = start;
    let mut next_progress = start + Duration::from_secs(60);
    let mut compactions = 0u64;
    let mut next_compaction = (!cli.compact_every.is_zero()).then(|| start + cli.compact_every);
    loop {
        let now = Instant::now();
        if now >= next_sample {
            if let Some(status) = agent.exited() {
                bail!(
                    "the agent exited ({status}) {:.0} s into the churn:{}",
                    now.duration_since(start).as_secs_f64(),
                    agent.tail()
                );
            }
            samples.push(sample(now.duration_since(start), written)?);
            next_sample += cli.sample_every;
        }
        if now >= next_progress {
            let s = samples.last().expect("sampled at the start");
            progress(&format!(
                "{:>4.0} s: {written} changes ({:.1}/s), agent RSS {:.1} MiB, {} fds, {} threads, {} set elements (soak RSS {:.0} MiB)",
                s.t_s,
                written as f64 / now.duration_since(start).as_secs_f64(),
                s.rss_kib as f64 / 1024.0,
                s.fds,
                s.threads,
                s.elements.map_or("?".into(), |e| format!("{e:.0}")),
                s.soak_rss_kib as f64 / 1024.0
            ));
            next_progress += Duration::from_secs(60);
        }
        if now >= end {
            break;
        }
        if let Some(at) = next_compaction
            && now >= at
        {
            // A pause first, so that every watch has sent what it had.
            std::thread::sleep(Duration::from_millis(100));
            api.compact();
            compactions += 1;
            next_compaction = Some(at + cli.compact_every);
            continue;
        }
        if now >= next_write {
            max_lag = max_lag.max(now - next_write);
            let i = rng.below(cli.services);
            let pods = rng.distinct(cli.endpoints, cli.pod_ips);
            let at = objects::rfc3339(SystemTime::now());
            match api.apply(objects::slice(i, &pods, Some(&at))) {
                Ok(_) => written += 1,
                Err(e) => {
                    api_errors += 1;
                    if api_errors <= 5 {
                        eprintln!("nftproxy-soak: writing a slice: {e:#}");
                    }
                }
            }
            next_write = start + Duration::from_secs_f64((written + api_errors) as f64 / cli.rate);
            continue;
        }
        let wake = next_write
            .min(next_sample)
            .min(end)
            .min(next_compaction.unwrap_or(end));
        std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    }
    let churn = start.elapsed();
    if samples
        .last()
        .is_none_or(|s| churn.as_secs_f64() - s.t_s > 1.0)
    {
        samples.push(sample(churn, written)?);
    }
    progress(&format!(
        "churn done: {written} changes in {:.1} s; checking the kernel in {:?}",
        churn.as_secs_f64(),
        cli.settle
    ));

    // The exact check, after the agent had time to sync the last changes.
    std::thread::sleep(cli.settle);
    if let Some(status) = agent.exited() {
        bail!(
            "the agent exited ({status}) after the churn:{}",
            agent.tail()
        );
    }
    let mut check = check::check(&ns, &api, &config_text)?;
    check.at_s = start.elapsed().as_secs_f64() - churn.as_secs_f64();
    let mut rechecks = Vec::new();
    if check.pending_ops() > 0 {
        progress(&format!(
            "the kernel differs from the objects by {} operations; checking again for up to 30 s",
            check.pending_ops()
        ));
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            std::thread::sleep(Duration::from_secs(2));
            let mut again = check::check(&ns, &api, &config_text)?;
            again.at_s = start.elapsed().as_secs_f64() - churn.as_secs_f64();
            let done = again.pending_ops() == 0;
            rechecks.push(again);
            if done {
                break;
            }
        }
    }
    let metrics_after = probe::scrape(&ns, metrics_addr);
    let (metrics, metrics_error) = match (&metrics_before, &metrics_after) {
        (Ok(b), Ok(a)) => (Some(agent_metrics(b, a)), None),
        (Err(e), _) | (_, Err(e)) => (None, Some(format!("{e:#}"))),
    };
    let requests: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.at >= start)
        .collect();
    let api_lists = requests
        .iter()
        .filter(|r| r.method == "GET" && !r.is_watch())
        .count();
    let api_watches = requests.iter().filter(|r| r.is_watch()).count();
    let api_failed = requests
        .iter()
        .filter(|r| r.status.is_some_and(|s| s != 200))
        .count();
    let alive = agent.exited().is_none();
    let exit = agent.stop();
    ensure!(
        alive,
        "the agent exited ({exit:?}) during the check:{}",
        agent.tail()
    );
    let (agent_warnings, agent_errors, agent_first_warnings) =
        agent.with_log(|l| (l.warnings, l.errors, l.first_warnings.clone()));
    drop(agent);
    drop(api);
    drop(ns);

    let w = warmup(cli);
    let stats_of = |f: &dyn Fn(&Sample) -> f64| {
        series_stats(&samples, w.as_secs_f64(), churn.as_secs_f64(), f)
    };
    let rss_mib = stats_of(&|s| s.rss_kib as f64 / 1024.0);
    let fds = stats_of(&|s| s.fds as f64);
    let threads = stats_of(&|s| s.threads as f64);
    let churn_cpu_s = samples.last().map_or(0.0, |l| l.cpu_s) - samples[0].cpu_s;
    let churn_s = churn.as_secs_f64();
    let mut report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        date: objects::rfc3339(SystemTime::now())[..19].to_string() + "Z",
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        seed,
        services: cli.services,
        endpoints_per_service: cli.endpoints,
        pod_ips: cli.pod_ips,
        rate_target: cli.rate,
        duration_s: cli.duration.as_secs_f64(),
        min_sync_period: cli.min_sync_period.clone(),
        sync_period: cli.sync_period.clone(),
        sample_every_s: cli.sample_every.as_secs_f64(),
        warmup_s: w.as_secs_f64(),
        load_s,
        first_sync_s,
        changes_written: written,
        churn_s,
        changes_per_s: written as f64 / churn_s,
        api_errors,
        max_writer_lag_ms: max_lag.as_secs_f64() * 1e3,
        churn_cpu_s,
        churn_cpu_pct: churn_cpu_s / churn_s * 100.0,
        samples,
        rss_mib,
        fds,
        threads,
        metrics,
        metrics_error,
        check,
        rechecks,
        agent_warnings,
        agent_errors,
        agent_first_warnings,
        compactions,
        api_lists,
        api_watches,
        api_failed,
        soak_rss_mib: probe::rss_kib(std::process::id()).map_or(0.0, |k| k as f64 / 1024.0),
        targets: Vec::new(),
    };
    report.targets = targets(&report);
    Ok(report)
}
