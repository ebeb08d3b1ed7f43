//! `nftproxy-bench`: how nftproxy scales with the number of Services, against kube-proxy's
//! nftables ruleset shape loaded with `nft -f`. See docs/performance.md.
//!
//! Needs root (network namespaces, nf_tables). Everything happens in namespaces named
//! `nftpb-<pid>-…` that are connected only to each other and deleted at the end, also on
//! failure and on Ctrl-C.

mod heap;
mod kubeproxy;
mod measure;
mod netns;
mod probes;
mod realistic;
mod synth;

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
                cli.reps,
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

// ---------------------------------------------------------------------------------------------
// Targets

fn size(sizes: &[SizeReport], n: usize) -> Option<&SizeReport> {
    sizes.iter().find(|s| s.services == n)
}

fn v4_cold(s: &SizeReport) -> Option<&Phases> {
    s.phases.as_ref()?.cold.get("IPv4")
}

fn partial<'a>(s: &'a SizeReport, op: &str) -> Option<&'a SyncRun> {
    s.syncer.as_ref()?.partial.get(op)
}

/// The slower of an endpoint addition and removal (wall ms), from medians by operation key.
fn endpoint_change(medians: &BTreeMap<String, SyncRun>) -> Option<f64> {
    let added = medians.get("endpoint_added")?.wall_ms;
    let removed = medians.get("endpoint_removed")?.wall_ms;
    Some(added.max(removed))
}

/// The targets of one shape, as they are added.
struct Targets {
    shape: Shape,
    out: Vec<Target>,
}

impl Targets {
    fn push(&mut self, target: &str, v: Option<(String, bool)>) {
        let (measured, pass) = match v {
            Some((measured, pass)) => (measured, Some(pass)),
            None => ("not measured in this run".into(), None),
        };
        self.out.push(Target {
            shape: self.shape,
            target: target.into(),
            measured,
            pass,
        });
    }

    /// At 10k Services, ≥ 10× faster than kube-proxy's shape with `nft -f`.
    fn versus_kube_proxy(&mut self, sizes: &[SizeReport]) {
        self.push(
            "at 10k Services, >= 10x faster than kube-proxy's shape with nft -f (IPv4)",
            size(sizes, 10000).and_then(|s| {
                let ours = v4_cold(s)?.total_ms;
                let base = s.baseline.as_ref()?.full.wall_ms;
                let ratio = base / ours;
                Some((
                    format!("{:.0} ms vs {:.0} ms: {ratio:.1}x", base, ours),
                    ratio >= 10.0,
                ))
            }),
        );
    }

    /// One endpoint change ≤ 10 ms at every size, and within ±50% between the smallest and the
    /// largest size.
    fn endpoint_change_flat(&mut self, sizes: &[SizeReport]) {
        let ep: Vec<(usize, f64)> = sizes
            .iter()
            .filter_map(|s| Some((s.services, endpoint_change(&s.syncer.as_ref()?.partial)?)))
            .collect();
        self.push(
            "partial sync of one endpoint change <= 10 ms (every size)",
            (!ep.is_empty()).then(|| {
                let worst = ep.iter().map(|(_, v)| *v).fold(0.0, f64::max);
                let list: Vec<String> = ep
                    .iter()
                    .map(|(n, v)| format!("{}: {v:.3} ms", short(*n)))
                    .collect();
                (list.join(", "), worst <= 10.0)
            }),
        );
        let small = sizes.iter().map(|s| s.services).min().unwrap_or(1000);
        let large = sizes.iter().map(|s| s.services).max().unwrap_or(50000);
        // The two sizes synced alternately if they were (same machine state), else one after
        // the other.
        let side = |n: usize| endpoint_change(size(sizes, n)?.side_by_side.as_ref()?);
        let apart = |n: usize| ep.iter().find(|(m, _)| *m == n).map(|(_, v)| *v);
        let flatness = side(small)
            .zip(side(large))
            .map(|pair| (pair, "synced alternately"))
            .or_else(|| {
                apart(small)
                    .zip(apart(large))
                    .map(|p| (p, "one size after the other"))
            });
        self.push(
            &format!(
                "partial sync of one endpoint change within +-50% between {} and {}",
                short(small),
                short(large)
            ),
            flatness.filter(|_| small != large).map(|((a, b), how)| {
                let ratio = b / a;
                (
                    format!("{a:.3} ms -> {b:.3} ms ({ratio:.2}x, {how})"),
                    (0.5..=1.5).contains(&ratio),
                )
            }),
        );
    }

    /// First-packet p50 at `n` Services within 20% of one Service.
    fn first_packet(&mut self, sizes: &[SizeReport], n: usize) {
        self.push(
            &format!("first-packet p50 at {} within 20% of 1 Service", short(n)),
            size(sizes, n).and_then(|s| s.latency.as_ref()).map(|l| {
                let ratio = l.loaded.p50_us / l.one_service.p50_us;
                (
                    format!(
                        "{:.0} us vs {:.0} us ({:+.0}%)",
                        l.loaded.p50_us,
                        l.one_service.p50_us,
                        (ratio - 1.0) * 100.0
                    ),
                    ratio <= 1.2,
                )
            }),
        );
    }
}

/// The uniform shape's targets (the project's original ones).
fn uniform_targets(sizes: &[SizeReport], k: usize) -> Vec<Target> {
    let mut t = Targets {
        shape: Shape::Uniform,
        out: Vec::new(),
    };
    let k_note = if k == 5 {
        ""
    } else {
        " (run with --endpoints 5)"
    };
    t.push(
        &format!("cold full sync, IPv4, 30k Services x 5 endpoints <= 1.0 s{k_note}"),
        size(sizes, 30000)
            .and_then(v4_cold)
            .filter(|_| k == 5)
            .map(|p| (format!("{:.0} ms", p.total_ms), p.total_ms <= 1000.0)),
    );
    t.versus_kube_proxy(sizes);
    t.endpoint_change_flat(sizes);
    t.push(
        &format!("peak RSS of the agent <= 200 MiB at 30k x 5 (run --once){k_note}"),
        size(sizes, 30000)
            .filter(|_| k == 5)
            .and_then(|s| s.agent.as_ref())
            .map(|a| {
                let mib = a.once.max_rss_kib as f64 / 1024.0;
                (
                    format!(
                        "{mib:.0} MiB (daemon after its first sync: {:.0} MiB)",
                        a.daemon_rss_mib
                    ),
                    mib <= 200.0,
                )
            }),
    );
    t.first_packet(sizes, 30000);
    t.out
}

/// Issue 20's targets, on the realistic shape at 100k Services, and the generic ones.
fn realistic_targets(sizes: &[SizeReport]) -> Vec<Target> {
    let mut t = Targets {
        shape: Shape::Realistic,
        out: Vec::new(),
    };
    let at = size(sizes, 100_000);
    let probes = at.and_then(|s| s.probes.as_ref());
    let op_list = |p: &BTreeMap<String, probes::ProbeOp>, ops: &[&str]| {
        let figures: Vec<Option<f64>> = ops.iter().map(|op| Some(p.get(*op)?.median_ms)).collect();
        let worst = figures.iter().copied().collect::<Option<Vec<f64>>>()?;
        let text: Vec<String> = figures.iter().map(|v| f(v.unwrap_or(f64::NAN))).collect();
        Some((
            format!("{} ms", text.join(" / ")),
            worst.iter().all(|&v| v <= 1.0),
        ))
    };
    for aff in [false, true] {
        for k in probes::ENDPOINTS {
            let name = probes::label(k, aff);
            t.push(
                &format!(
                    "100k: Service with {name}: endpoint added / removed, Service added / deleted <= 1 ms each (medians)"
                ),
                probes
                    .and_then(|p| p.probes.get(&name))
                    .and_then(|p| op_list(p, &probes::OPS)),
            );
        }
    }
    for (name, _, ops) in probes::boundaries() {
        let ops: Vec<&str> = ops.iter().map(String::as_str).collect();
        t.push(
            &format!(
                "100k: Service crossing {} endpoints ({}) <= 1 ms each way (medians)",
                ops[0],
                name.trim_start_matches("boundary ")
            ),
            probes
                .and_then(|p| p.probes.get(&name))
                .and_then(|p| op_list(p, &ops)),
        );
    }
    t.push(
        "100k: cold full sync, both families (Syncer::sync) <= 4 s",
        at.and_then(|s| s.syncer.as_ref()).map(|r| {
            (
                format!("{:.0} ms", r.cold.wall_ms),
                r.cold.wall_ms <= 4000.0,
            )
        }),
    );
    t.push(
        "100k: agent memory <= 2 KiB per Service (daemon RSS after its first sync)",
        at.and_then(|s| {
            let a = daemon(s)?;
            let kib = a.daemon_rss_mib * 1024.0 / s.services as f64;
            Some((
                format!("{kib:.2} KiB ({:.0} MiB)", a.daemon_rss_mib),
                kib <= 2.0,
            ))
        }),
    );
    t.versus_kube_proxy(sizes);
    t.endpoint_change_flat(sizes);
    let largest = sizes.iter().map(|s| s.services).max().unwrap_or(100_000);
    t.first_packet(sizes, largest);
    t.out
}

/// The daemon's figures, when it ran.
fn daemon(s: &SizeReport) -> Option<&AgentResult> {
    s.agent.as_ref().filter(|a| a.idle_window_s > 0.0)
}

// ---------------------------------------------------------------------------------------------
// The table

fn short(n: usize) -> String {
    if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    }
}

fn f(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v < 1.0 {
        format!("{v:.3}")
    } else if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

fn mib(bytes: f64) -> String {
    f(bytes / (1024.0 * 1024.0))
}

struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn section(&mut self, title: &str) {
        self.rows.push(vec![title.to_string()]);
    }

    fn row(&mut self, label: &str, cells: Vec<String>) {
        let mut r = vec![format!("  {label}")];
        r.extend(cells);
        self.rows.push(r);
    }

    fn render(&self) -> String {
        let cols = self.header.len();
        let mut width = vec![0; cols];
        for r in std::iter::once(&self.header).chain(self.rows.iter().filter(|r| r.len() > 1)) {
            for (i, c) in r.iter().enumerate() {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, r: &[String]| {
            for (i, c) in r.iter().enumerate() {
                if i == 0 {
                    let _ = write!(out, "{c:<w$}", w = width[0]);
                } else {
                    let _ = write!(out, "  {c:>w$}", w = width[i]);
                }
            }
            out.push('\n');
        };
        line(&mut out, &self.header);
        for r in &self.rows {
            if r.len() == 1 {
                let _ = writeln!(out, "{}", r[0]);
            } else {
                line(&mut out, r);
            }
        }
        out
    }
}

fn render(report: &Report, cli: &Cli) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "nftproxy-bench: {} endpoints per Service; kernel {}; {}; {} CPUs; bench built {}",
        cli.endpoints, report.kernel, report.nft, report.cpus, report.bench_profile
    );
    let _ = writeln!(
        out,
        "load average (1/5/15 min) at start: {}; at end: {}",
        report.loadavg_start, report.loadavg_end
    );
    let mut shapes: Vec<Shape> = report.sizes.iter().map(|s| s.shape).collect();
    shapes.dedup();
    let titled = shapes.len() > 1 || shapes.iter().any(|s| *s != Shape::Uniform);
    for shape in shapes {
        let sizes: Vec<&SizeReport> = report.sizes.iter().filter(|s| s.shape == shape).collect();
        out.push('\n');
        if titled {
            let _ = writeln!(
                out,
                "{}",
                match shape {
                    Shape::Uniform => format!(
                        "Uniform shape: every Service {} endpoints, one port, no affinity",
                        cli.endpoints
                    ),
                    Shape::Realistic => format!(
                        "Realistic shape (seed {:#x}): heavy-tailed endpoint counts, 5% ClientIP affinity, 20% multi-port, 30% dual-stack, mixed policies",
                        cli.seed
                    ),
                }
            );
        }
        out.push_str(&render_table(&sizes, cli, shape));
        out.push_str(if titled {
            match shape {
                Shape::Uniform => "\nTargets (uniform shape)\n",
                Shape::Realistic => "\nTargets (realistic shape)\n",
            }
        } else {
            "\nTargets\n"
        });
        for target in report.targets.iter().filter(|t| t.shape == shape) {
            let verdict = match target.pass {
                Some(true) => "PASS",
                Some(false) => "FAIL",
                None => "n/a ",
            };
            let _ = writeln!(out, "  {verdict}  {}: {}", target.target, target.measured);
        }
    }
    let errors: Vec<String> = report
        .sizes
        .iter()
        .flat_map(|s| {
            s.errors
                .iter()
                .map(move |e| format!("{} {}: {e}", s.shape.name(), short(s.services)))
        })
        .collect();
    if !errors.is_empty() {
        out.push_str("\nErrors\n");
        for e in errors {
            let _ = writeln!(out, "  {e}");
        }
    }
    out
}

fn kib_per_service(mib: f64, services: usize) -> String {
    f(mib * 1024.0 / services as f64)
}

fn render_table(sizes: &[&SizeReport], cli: &Cli, shape: Shape) -> String {
    let mut t = Table {
        header: std::iter::once("Services".to_string())
            .chain(sizes.iter().map(|s| short(s.services)))
            .collect(),
        rows: Vec::new(),
    };
    let col = |g: &dyn Fn(&SizeReport) -> Option<String>| -> Vec<String> {
        sizes
            .iter()
            .map(|s| g(s).unwrap_or_else(|| "-".into()))
            .collect()
    };
    let realistic = shape == Shape::Realistic;
    let v4 = |s: &SizeReport| v4_cold(s).cloned();
    let ops = |s: &SizeReport, op: &str| partial(s, op).cloned();
    let phase_op =
        |s: &SizeReport, op: &str| s.phases.as_ref()?.partial.get(op)?.get("IPv4").cloned();

    t.section("Cluster");
    t.row(
        "endpoints (IPv4 / IPv6)",
        col(&|s| {
            Some(format!(
                "{} / {}",
                s.model.endpoints_v4, s.model.endpoints_v6
            ))
        }),
    );
    if realistic {
        t.row(
            "Services: NodePort / LB / dual-stack / multi-port / ClientIP / eTP, iTP Local",
            col(&|s| {
                let m = &s.model;
                Some(format!(
                    "{} / {} / {} / {} / {} / {}, {}",
                    m.node_port,
                    m.load_balancer,
                    m.dual_stack,
                    m.multi_port,
                    m.affinity,
                    m.etp_local,
                    m.itp_local
                ))
            }),
        );
        t.row(
            "Services by endpoints: 0 / 1-3 / 4-16 / 17-99 / 100-999 / 1000+ (max)",
            col(&|s| {
                let b = &s.model.by_endpoints;
                Some(format!(
                    "{} / {} / {} / {} / {} / {} ({})",
                    b[0], b[1], b[2], b[3], b[4], b[5], s.model.endpoints_max
                ))
            }),
        );
    }
    t.row(
        "IPv4 table: chains / rules / elements",
        col(&|s| {
            Some(format!(
                "{} / {} / {}",
                s.table_v4.chains, s.table_v4.rules, s.table_v4.elements
            ))
        }),
    );

    t.section("Cold full sync, nftproxy (netlink), model -> committed kernel state");
    t.row("IPv4 wall, ms", col(&|s| v4(s).map(|p| f(p.total_ms))));
    t.row(
        "both families wall (Syncer::sync), ms",
        col(&|s| s.syncer.as_ref().map(|r| f(r.cold.wall_ms))),
    );
    t.row(
        "sync CPU user / sys, ms",
        col(&|s| {
            s.syncer
                .as_ref()
                .map(|r| format!("{} / {}", f(r.cold.user_ms), f(r.cold.sys_ms)))
        }),
    );
    t.row(
        "IPv4 netlink messages / MiB",
        col(&|s| {
            s.syncer
                .as_ref()
                .map(|r| format!("{} / {}", r.cold.v4_messages, mib(r.cold.v4_bytes as f64)))
        }),
    );
    t.row(
        "all netlink messages / MiB",
        col(&|s| {
            s.syncer
                .as_ref()
                .map(|r| format!("{} / {}", r.cold.messages, mib(r.cold.bytes as f64)))
        }),
    );
    t.row(
        "IPv4 build / read back / plan / apply / other, ms",
        col(&|s| {
            v4(s).map(|p| {
                format!(
                    "{} / {} / {} / {} / {}",
                    f(p.build_ms),
                    f(p.state_ms),
                    f(p.plan_ms),
                    f(p.kernel_ms),
                    f(p.other_ms)
                )
            })
        }),
    );
    t.row(
        "IPv4 apply CPU: encode (user) / nf_tables (sys), ms",
        col(&|s| v4(s).map(|p| format!("{} / {}", f(p.kernel_user_ms), f(p.kernel_sys_ms)))),
    );
    t.row(
        "heap: model (both families), MiB",
        col(&|s| Some(f(s.model_heap_mib))),
    );
    t.row(
        "IPv4 heap: table / transaction / apply peak / state, MiB",
        col(&|s| {
            v4(s).map(|p| {
                format!(
                    "{} / {} / {} / {}",
                    f(p.heap_table_mib),
                    f(p.heap_transaction_mib),
                    f(p.heap_apply_peak_mib),
                    f(p.heap_state_mib)
                )
            })
        }),
    );
    t.row(
        "IPv4 heap peak during the sync, MiB",
        col(&|s| v4(s).map(|p| f(p.heap_sync_peak_mib))),
    );
    t.row(
        "heap per Service: model / IPv4 state, KiB",
        col(&|s| {
            v4(s).map(|p| {
                format!(
                    "{} / {}",
                    kib_per_service(s.model_heap_mib, s.services),
                    kib_per_service(p.heap_state_mib, s.services)
                )
            })
        }),
    );

    t.section("Baseline: kube-proxy's shape, nft -f (IPv4, table ip kube-proxy)");
    let base = |s: &SizeReport| -> Option<Result<BaselineResult, &'static str>> {
        if s.baseline_skipped {
            Some(Err("skipped"))
        } else {
            s.baseline.clone().map(Ok)
        }
    };
    let base_cell = |s: &SizeReport, g: &dyn Fn(&BaselineResult) -> Option<String>| match base(s)? {
        Ok(b) => g(&b),
        Err(e) => Some(e.to_string()),
    };
    t.row(
        "full load wall, ms",
        col(&|s| base_cell(s, &|b| Some(f(b.full.wall_ms)))),
    );
    t.row(
        "nft CPU user / sys, ms",
        col(&|s| {
            base_cell(s, &|b| {
                Some(format!("{} / {}", f(b.full.user_ms), f(b.full.sys_ms)))
            })
        }),
    );
    t.row(
        "nft -f text lines / MiB",
        col(&|s| {
            base_cell(s, &|b| {
                Some(format!("{} / {}", b.text_lines, mib(b.text_bytes as f64)))
            })
        }),
    );
    t.row(
        "ratio baseline / nftproxy (IPv4 full)",
        col(&|s| {
            base_cell(s, &|b| {
                v4(s).map(|p| format!("{:.1}x", b.full.wall_ms / p.total_ms))
            })
        }),
    );
    t.row(
        "add 1 Service with nft -f, ms",
        col(&|s| base_cell(s, &|b| Some(f(b.add_service_ms)))),
    );
    t.row(
        "ratio baseline / nftproxy (add Service, IPv4)",
        col(&|s| {
            base_cell(s, &|b| {
                phase_op(s, "service_added")
                    .map(|p| format!("{:.1}x", b.add_service_ms / p.total_ms))
            })
        }),
    );

    t.section(&format!(
        "Partial syncs, nftproxy (Syncer::sync, full=false), median of {} after a warm-up round: wall ms / messages",
        cli.reps
    ));
    let wall_messages = |r: &SyncRun| format!("{} / {}", f(r.wall_ms), r.messages);
    for op in measure::PartialOp::ALL {
        t.row(
            op.name(),
            col(&|s| ops(s, op.key()).map(|r| wall_messages(&r))),
        );
    }
    type Medians = fn(&SizeReport) -> Option<&BTreeMap<String, SyncRun>>;
    let endpoint_views: [(&str, Medians); 2] = [
        ("CPU caches emptied first", |s| {
            s.syncer.as_ref().map(|r| &r.cold_cache)
        }),
        ("smallest and largest size synced alternately", |s| {
            s.side_by_side.as_ref()
        }),
    ];
    for (view, medians) in endpoint_views {
        for op in measure::PartialOp::ENDPOINT_CHANGES {
            t.row(
                &format!("{}, {view}", op.name()),
                col(&|s| medians(s)?.get(op.key()).map(wall_messages)),
            );
        }
    }
    t.row(
        "endpoint added: CPU user / sys, ms",
        col(&|s| ops(s, "endpoint_added").map(|r| format!("{} / {}", f(r.user_ms), f(r.sys_ms)))),
    );
    t.row(
        "endpoint added, IPv4: build / clone / plan / apply / other",
        col(&|s| {
            phase_op(s, "endpoint_added").map(|p| {
                format!(
                    "{} / {} / {} / {} / {}",
                    f(p.build_ms),
                    f(p.state_ms),
                    f(p.plan_ms),
                    f(p.kernel_ms),
                    f(p.other_ms)
                )
            })
        }),
    );
    t.row(
        "  other: state update / cleanup / conntrack / free",
        col(&|s| {
            phase_op(s, "endpoint_added").map(|p| {
                format!(
                    "{} / {} / {} / {}",
                    f(p.state_update_ms),
                    f(p.cleanup_ms),
                    f(p.frontends_ms),
                    f(p.free_ms)
                )
            })
        }),
    );
    t.row(
        "endpoint added, IPv4 apply: nf_tables (sys), ms",
        col(&|s| phase_op(s, "endpoint_added").map(|p| f(p.kernel_sys_ms))),
    );
    t.row(
        "Service deleted, IPv4 apply: nf_tables (sys), ms",
        col(&|s| phase_op(s, "service_deleted").map(|p| f(p.kernel_sys_ms))),
    );
    t.row(
        "sync loop's model snapshot (Cluster::clone + drop), ms",
        col(&|s| Some(f(s.model_clone_ms))),
    );
    t.row(
        "endpoint added, IPv6 (unchanged family) total",
        col(&|s| {
            s.phases
                .as_ref()?
                .partial
                .get("endpoint_added")?
                .get("IPv6")
                .map(|p| f(p.total_ms))
        }),
    );

    t.section("Agent process (nftproxy run --from-file)");
    t.row(
        "--once: wall, ms",
        col(&|s| s.agent.as_ref().map(|a| f(a.once.wall_ms))),
    );
    t.row(
        "--once: peak RSS (VmHWM), MiB",
        col(&|s| {
            s.agent
                .as_ref()
                .map(|a| f(a.once.max_rss_kib as f64 / 1024.0))
        }),
    );
    t.row(
        "--once: CPU user / sys, ms",
        col(&|s| {
            s.agent
                .as_ref()
                .map(|a| format!("{} / {}", f(a.once.user_ms), f(a.once.sys_ms)))
        }),
    );
    t.row(
        "input file, MiB",
        col(&|s| s.agent.as_ref().map(|a| mib(a.file_bytes as f64))),
    );
    t.row(
        "daemon: first sync done after, ms",
        col(&|s| daemon(s).map(|a| f(a.daemon_first_sync_ms))),
    );
    t.row(
        "daemon: RSS after first sync / peak, MiB",
        col(&|s| {
            daemon(s).map(|a| format!("{} / {}", f(a.daemon_rss_mib), f(a.daemon_peak_rss_mib)))
        }),
    );
    t.row(
        "daemon: RSS after first sync per Service, KiB",
        col(&|s| daemon(s).map(|a| kib_per_service(a.daemon_rss_mib, s.services))),
    );
    t.row(
        &format!("daemon: CPU while idle for {} s, ms", cli.idle_seconds),
        col(&|s| daemon(s).map(|a| f(a.idle_cpu_ms))),
    );
    t.row(
        "daemon: nft delete table ip nftproxy / then rebuilt after, ms",
        col(&|s| {
            daemon(s).map(|a| format!("{} / {}", f(a.table_delete_ms), f(a.daemon_repair_ms)))
        }),
    );

    if sizes.iter().any(|s| s.probes.is_some()) {
        t.section(&format!(
            "Partial syncs by Service shape (probe Services added to the cluster; Syncer::sync, full=false), median / max of {} after a warm-up round: ms / messages",
            cli.probe_reps
        ));
        t.row(
            "cold full sync with the probes, both families, ms",
            col(&|s| s.probes.as_ref().map(|p| f(p.cold_ms))),
        );
        let order = sizes
            .iter()
            .find_map(|s| s.probes.as_ref())
            .map(|p| p.order.clone())
            .unwrap_or_default();
        for probe in &order {
            let ops: Vec<String> = sizes
                .iter()
                .find_map(|s| s.probes.as_ref()?.probes.get(probe))
                .map(|m| {
                    // The probe's operations in the order they were measured.
                    let mut ops: Vec<String> = probes::OPS
                        .iter()
                        .map(|o| o.to_string())
                        .filter(|o| m.contains_key(o))
                        .collect();
                    let rest: Vec<String> =
                        m.keys().filter(|k| !ops.contains(k)).cloned().collect();
                    ops.extend(rest);
                    ops
                })
                .unwrap_or_default();
            for op in ops {
                t.row(
                    &format!("{probe}: {op}"),
                    col(&|s| {
                        let r = s.probes.as_ref()?.probes.get(probe)?.get(&op)?;
                        Some(format!(
                            "{} / {} / {}",
                            f(r.median_ms),
                            f(r.max_ms),
                            r.messages
                        ))
                    }),
                );
            }
        }
    }

    t.section(&format!(
        "First-packet latency: TCP connect() through a ClusterIP, {} connections, us",
        cli.connections
    ));
    t.row(
        "1 Service: p50 / p99",
        col(&|s| {
            s.latency
                .as_ref()
                .map(|l| format!("{} / {}", f(l.one_service.p50_us), f(l.one_service.p99_us)))
        }),
    );
    t.row(
        "N Services: p50 / p99",
        col(&|s| {
            s.latency
                .as_ref()
                .map(|l| format!("{} / {}", f(l.loaded.p50_us), f(l.loaded.p99_us)))
        }),
    );
    t.row(
        "p50 N / 1",
        col(&|s| {
            s.latency.as_ref().map(|l| {
                format!(
                    "{:+.0}%",
                    (l.loaded.p50_us / l.one_service.p50_us - 1.0) * 100.0
                )
            })
        }),
    );
    t.row(
        "direct to the pod (no DNAT), 1 / N: p50",
        col(&|s| {
            s.latency.as_ref().map(|l| {
                format!(
                    "{} / {}",
                    f(l.direct_one_service.p50_us),
                    f(l.direct_loaded.p50_us)
                )
            })
        }),
    );

    t.render()
}
