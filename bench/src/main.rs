//! `nftproxy-bench`: how nftproxy scales with the number of Services, against kube-proxy's
//! nftables ruleset shape loaded with `nft -f`. See docs/performance.md.
//!
//! Needs root (network namespaces, nf_tables). Everything happens in namespaces named
//! `nftpb-<pid>-…` that are connected only to each other and deleted at the end, also on
//! failure and on Ctrl-C.

mod drift;
mod heap;
mod kubeproxy;
mod measure;
mod netns;
mod probes;
mod realistic;
mod synth;
mod table;
mod targets;

use self::table::*;
use self::targets::*;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use dataplane::nft::build::build;
use dataplane::nft::ruleset::Family;
use serde::Serialize;

use crate::measure::{
    AgentResult, BaselineResult, LatencyResult, PhasedResult, Phases, SyncRun, SyncerResult,
};
use crate::probes::ProbeResult;
use crate::synth::{ModelStats, Shape, TableStats};

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

#[derive(Parser, Debug)]
#[command(
    name = "nftproxy-bench",
    about = "Scale benchmark: sync times, memory and first-packet latency of nftproxy, \
             with kube-proxy's nftables ruleset shape (nft -f) as the baseline"
)]
struct Cli {
    /// Cluster sizes (number of Services), comma-separated.
    #[arg(
        long,
        visible_alias = "sizes",
        value_delimiter = ',',
        default_value = "1000,10000,30000,50000"
    )]
    services: Vec<usize>,
    /// Cluster shapes, comma-separated: `uniform` (every Service alike, --endpoints each) and
    /// `realistic` (a seeded mix like a real cluster's; see docs/performance.md). Each shape
    /// gets its own table and targets.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "uniform")]
    shape: Vec<Shape>,
    /// Endpoints per Service (uniform shape; also the Services the generic partial syncs add).
    #[arg(long, default_value_t = 5)]
    endpoints: usize,
    /// Seed of the realistic shape.
    #[arg(long, default_value_t = realistic::DEFAULT_SEED)]
    seed: u64,
    /// Repetitions of each per-Service-shape partial sync (realistic shape), after one
    /// unrecorded round.
    #[arg(long, default_value_t = 5)]
    probe_reps: usize,
    /// Skip the per-Service-shape partial syncs (realistic shape).
    #[arg(long)]
    no_probes: bool,
    /// Largest size for which the kube-proxy-shaped baseline is loaded (it is quadratic).
    #[arg(long, default_value_t = 10000)]
    baseline_max: usize,
    /// Repetitions of each partial sync (medians are reported), after one unrecorded round.
    #[arg(long, default_value_t = 21)]
    reps: usize,
    /// TCP connections per first-packet latency measurement.
    #[arg(long, default_value_t = 2000)]
    connections: usize,
    /// Seconds the daemon's CPU is watched after its first sync (0: skip the daemon run).
    #[arg(long, default_value_t = 10)]
    idle_seconds: u64,
    /// The nftproxy binary (default: next to this one).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Also write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Skip the first-packet latency measurement.
    #[arg(long)]
    no_latency: bool,
    /// Skip the runs of the real agent binary (peak RSS, idle CPU).
    #[arg(long)]
    no_agent: bool,
    /// Print the kube-proxy-shaped baseline (nft -f text) for the first size and exit.
    #[arg(long)]
    print_baseline: bool,
    /// Write the synthetic cluster of the first size (and first shape) as Kubernetes YAML to
    /// this file (and the agent configuration to FILE.config.yaml), then exit.
    #[arg(long, value_name = "FILE")]
    write_cluster: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct SizeReport {
    shape: Shape,
    services: usize,
    endpoints_per_service: usize,
    model: ModelStats,
    table_v4: TableStats,
    table_v6: TableStats,
    generate_ms: f64,
    /// Heap bytes the converted cluster model holds, MiB.
    model_heap_mib: f64,
    /// `Cluster::clone` plus dropping the clone (the sync loop snapshots the model so), ms.
    model_clone_ms: f64,
    syncer: Option<SyncerResult>,
    phases: Option<PhasedResult>,
    baseline: Option<BaselineResult>,
    baseline_skipped: bool,
    agent: Option<AgentResult>,
    latency: Option<LatencyResult>,
    /// Endpoint changes synced alternately with those of the other end of the size range
    /// (smallest and largest size): medians by operation key.
    side_by_side: Option<BTreeMap<String, SyncRun>>,
    /// Partial syncs by Service shape (realistic shape only).
    probes: Option<ProbeResult>,
    errors: Vec<String>,
}

impl SizeReport {
    fn new(shape: Shape, services: usize, endpoints_per_service: usize) -> SizeReport {
        SizeReport {
            shape,
            services,
            endpoints_per_service,
            model: ModelStats::default(),
            table_v4: TableStats::default(),
            table_v6: TableStats::default(),
            generate_ms: 0.0,
            model_heap_mib: 0.0,
            model_clone_ms: 0.0,
            syncer: None,
            phases: None,
            baseline: None,
            baseline_skipped: false,
            agent: None,
            latency: None,
            side_by_side: None,
            probes: None,
            errors: Vec::new(),
        }
    }
}

#[derive(Debug, Serialize)]
struct Target {
    shape: Shape,
    target: String,
    measured: String,
    /// `None`: not measured in this run.
    pass: Option<bool>,
}

#[derive(Debug, Serialize)]
struct Report {
    command: String,
    kernel: String,
    nft: String,
    cpus: usize,
    /// /proc/loadavg when the run started and when it ended (the machine may be shared).
    loadavg_start: String,
    loadavg_end: String,
    bench_profile: &'static str,
    agent_binary: Option<String>,
    sizes: Vec<SizeReport>,
    targets: Vec<Target>,
}

fn main() {
    // The agent's allocator settings, for the syncs run in-process.
    nftproxy::memory::configure();
    if let Err(e) = real_main() {
        eprintln!("nftproxy-bench: {e:#}");
        netns::cleanup_all();
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    // SAFETY: geteuid has no memory effects.
    if unsafe { libc::geteuid() } != 0 {
        bail!("needs root (network namespaces and nf_tables)");
    }
    if cli.services.iter().any(|&n| n < 100) {
        bail!("--services: each size must be at least 100");
    }
    if cli.endpoints == 0 {
        bail!("--endpoints must be at least 1");
    }
    if cli.shape.is_empty() {
        bail!("--shape: name at least one shape");
    }
    let shape_objects = |shape: Shape, n: usize| {
        synth::objects_of(&synth::specs(shape, n, cli.endpoints, cli.seed))
    };
    if cli.print_baseline {
        let n = cli.services[0];
        let cluster = synth::to_cluster(&shape_objects(cli.shape[0], n))?;
        let env = kubeproxy::Env {
            node_name: synth::NODE,
            cluster_cidr: synth::CLUSTER_CIDR_V4,
        };
        print!(
            "{}",
            kubeproxy::full_text(&cluster, &env, synth::SERVICE_CIDR_V4, synth::NODE_IP_V4)
        );
        return Ok(());
    }
    if let Some(path) = &cli.write_cluster {
        synth::write_file(path, &shape_objects(cli.shape[0], cli.services[0]))?;
        let mut config = path.as_os_str().to_owned();
        config.push(".config.yaml");
        std::fs::write(&config, synth::kube_proxy_config())?;
        return Ok(());
    }
    let loadavg_start = loadavg();
    netns::install_signal_handler()?;
    netns::remove_stale();
    let dir = netns::TempDir::new()?;
    let agent = if cli.no_agent {
        None
    } else {
        Some(agent_binary(cli.agent.as_deref())?)
    };
    let config = measure::build_config()?;
    let config_file = dir.path().join("kube-proxy-config.yaml");
    std::fs::write(&config_file, synth::kube_proxy_config())?;

    let mut sizes = Vec::new();
    let mut targets = Vec::new();
    let mut shapes = cli.shape.clone();
    shapes.dedup();
    for &shape in &shapes {
        let mut of_shape = Vec::new();
        for &n in &cli.services {
            let report = bench_size(
                &cli,
                shape,
                n,
                &config,
                agent.as_deref(),
                &config_file,
                dir.path(),
            );
            print_progress(shape, n, "done");
            of_shape.push(report);
        }
        side_by_side(&cli, shape, &config, &mut of_shape);
        targets.extend(match shape {
            Shape::Uniform => uniform_targets(&of_shape, cli.endpoints),
            Shape::Realistic => realistic_targets(&of_shape),
        });
        sizes.extend(of_shape);
    }
    let report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        kernel: command_output("uname", &["-r"]),
        nft: command_output("nft", &["--version"]),
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg_start,
        loadavg_end: loadavg(),
        bench_profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        agent_binary: agent.map(|p| p.display().to_string()),
        sizes,
        targets,
    };
    print!("{}", render(&report, &cli));
    if let Some(path) = &cli.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Fewest rounds of the side-by-side endpoint changes, whatever `--reps` says: the flatness
/// target compares two medians, and with five rounds one slow interval on one side decided the
/// ratio (0.44x in one run of seven at 1k and 100k, 1.00-1.48x in the others).
const SIDE_BY_SIDE_MIN_REPS: usize = 21;

/// Endpoint changes of the smallest and the largest size, synced alternately (the flatness
/// target compares these two).
fn side_by_side(
    cli: &Cli,
    shape: Shape,
    config: &dataplane::nft::build::BuildConfig,
    sizes: &mut [SizeReport],
) {
    let (Some(small), Some(large)) = (cli.services.iter().min(), cli.services.iter().max()) else {
        return;
    };
    let (small, large, k) = (*small, *large, cli.endpoints);
    if small == large {
        return;
    }
    eprintln!(
        "[{} {small} and {large} Services] endpoint changes, alternately",
        shape.name()
    );
    let objects = |n: usize| synth::objects_of(&synth::specs(shape, n, k, cli.seed));
    let result = synth::to_cluster(&objects(small))
        .and_then(|a| Ok((a, synth::to_cluster(&objects(large))?)))
        .and_then(|(a, b)| {
            measure::side_by_side_bench(
                [
                    measure::SideBySideCluster {
                        n: small,
                        cluster: &a,
                    },
                    measure::SideBySideCluster {
                        n: large,
                        cluster: &b,
                    },
                ],
                config,
                k,
                cli.reps.max(SIDE_BY_SIDE_MIN_REPS),
            )
        });
    match result {
        Ok([a, b]) => {
            for (n, runs) in [(small, a), (large, b)] {
                if let Some(r) = sizes.iter_mut().find(|r| r.services == n) {
                    r.side_by_side = Some(runs);
                }
            }
        }
        Err(e) => {
            let msg = format!("endpoint changes side by side: {e:#}");
            eprintln!(
                "[{} {small} and {large} Services] FAILED {msg}",
                shape.name()
            );
            if let Some(r) = sizes.iter_mut().find(|r| r.services == large) {
                r.errors.push(msg);
            }
        }
    }
}

fn agent_binary(flag: Option<&Path>) -> Result<PathBuf> {
    let path = match flag {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()?
            .parent()
            .context("no directory")?
            .join("nftproxy"),
    };
    if !path.is_file() {
        bail!(
            "agent binary {} not found: build it (cargo build --release -p nftproxy -p nftproxy-bench), \
             pass --agent PATH, or use --no-agent",
            path.display()
        );
    }
    Ok(path)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn command_output(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn print_progress(shape: Shape, n: usize, what: &str) {
    eprintln!("[{} {n} Services] {what}", shape.name());
}

fn bench_size(
    cli: &Cli,
    shape: Shape,
    n: usize,
    config: &dataplane::nft::build::BuildConfig,
    agent: Option<&Path>,
    config_file: &Path,
    dir: &Path,
) -> SizeReport {
    let k = cli.endpoints;
    let mut r = SizeReport::new(shape, n, k);
    let record = |r: &mut SizeReport, what: &str, e: anyhow::Error| {
        let msg = format!("{what}: {e:#}");
        eprintln!("[{} {n} Services] FAILED {msg}", shape.name());
        r.errors.push(msg);
    };
    let progress = |what: &str| print_progress(shape, n, what);
    progress("generating the cluster");
    let t = Instant::now();
    let specs = synth::specs(shape, n, k, cli.seed);
    r.model = synth::stats_of(&specs);
    let objects = synth::objects_of(&specs);
    drop(specs);
    let before = heap::current();
    let cluster = match synth::to_cluster(&objects) {
        Ok(c) => c,
        Err(e) => {
            record(&mut r, "generating the cluster", e);
            return r;
        }
    };
    r.generate_ms = measure::ms(t.elapsed());
    r.model_heap_mib = heap::mib(heap::current().saturating_sub(before));
    let t = Instant::now();
    drop(std::hint::black_box(cluster.clone()));
    r.model_clone_ms = measure::ms(t.elapsed());
    r.table_v4 = synth::table_stats(&build(&cluster, config, Family::V4).table);
    r.table_v6 = synth::table_stats(&build(&cluster, config, Family::V6).table);
    let objects_file = dir.join(format!("cluster-{}-{n}.yaml", shape.name()));
    let file_bytes = if agent.is_some() {
        match synth::write_file(&objects_file, &objects) {
            Ok(b) => Some(b),
            Err(e) => {
                record(&mut r, "writing the cluster file", e);
                None
            }
        }
    } else {
        None
    };
    drop(objects);
    // Namespace labels: one letter per shape keeps them apart.
    let tag = &shape.name()[..1];

    progress("nftproxy: cold full sync and partial syncs (Syncer)");
    match measure::syncer_bench(&format!("sync{tag}{n}"), &cluster, config, n, k, cli.reps) {
        Ok(v) => r.syncer = Some(v),
        Err(e) => record(&mut r, "Syncer", e),
    }
    progress("nftproxy: the same syncs, phase by phase");
    match measure::phased_bench(&format!("phases{tag}{n}"), &cluster, config, n, k, cli.reps) {
        Ok(v) => r.phases = Some(v),
        Err(e) => record(&mut r, "phases", e),
    }
    if n <= cli.baseline_max {
        progress("baseline: kube-proxy shape with nft -f");
        let reps = cli.reps.min(3);
        match measure::baseline_bench(&format!("kp{tag}{n}"), &cluster, n, k, reps, dir) {
            Ok(v) => r.baseline = Some(v),
            Err(e) => record(&mut r, "baseline", e),
        }
    } else {
        r.baseline_skipped = true;
    }
    if let (Some(agent), Some(file_bytes)) = (agent, file_bytes) {
        progress("agent process: run --once, then the daemon idle");
        let idle = Duration::from_secs(cli.idle_seconds);
        match measure::agent_bench(
            &format!("agent{tag}{n}"),
            agent,
            &objects_file,
            config_file,
            file_bytes,
            idle,
            dir,
        ) {
            Ok(v) => r.agent = Some(v),
            Err(e) => record(&mut r, "agent", e),
        }
        let _ = std::fs::remove_file(&objects_file);
    }
    if shape == Shape::Realistic && !cli.no_probes {
        progress("nftproxy: partial syncs by Service shape");
        match probes::probe_bench(
            &format!("probe{tag}{n}"),
            &cluster,
            config,
            n,
            cli.probe_reps,
        ) {
            Ok(v) => r.probes = Some(v),
            Err(e) => record(&mut r, "probes", e),
        }
    }
    if !cli.no_latency {
        progress("first-packet latency");
        match measure::latency_bench(&format!("lat{tag}{n}"), &cluster, config, cli.connections) {
            Ok(v) => r.latency = Some(v),
            Err(e) => record(&mut r, "latency", e),
        }
    }
    r
}
