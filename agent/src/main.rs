//! `nftproxy`: the node agent and its tools.

use std::io::{IsTerminal, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};
use dataplane::model::Cluster;
use dataplane::nft::build::build;
use dataplane::nft::render;
use dataplane::nft::ruleset::{Family, Proto};
use dataplane::trace::{Host, Packet, trace};
use dataplane::tracker::Tracker;
use nftproxy::clock::SystemClock;
use nftproxy::config::{KubeProxyConfiguration, LogFormat, Overrides, ProxyMode, Settings};
use nftproxy::nftables::monitor::Monitor;
use nftproxy::node_wait::{NODE_WAIT, NodeWait};
use nftproxy::proxier::{self, Syncer};
use nftproxy::source;
use nftproxy::syncloop::{self, Shared, Wake};
use nftproxy::{addresses, apiclient, iptables, watch};

#[derive(Parser)]
#[command(
    name = "nftproxy",
    version,
    about = "A kube-proxy replacement that programs nftables over netlink"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct Common {
    /// A kube-proxy KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The name of this node (default: the config's hostnameOverride, else the hostname).
    #[arg(long)]
    hostname_override: Option<String>,
    /// nftables (default) or iptables.
    #[arg(long)]
    proxy_mode: Option<String>,
    /// Log verbosity, as kube-proxy's klog `-v`: 0-1 info, 2-3 debug, 4 and more trace
    /// (default: the config's logging.verbosity). RUST_LOG, when set, wins.
    #[arg(short = 'v', long = "v", value_name = "LEVEL")]
    verbosity: Option<u32>,
    /// Log format: text or json (default: the config's logging.format).
    #[arg(long, alias = "logging-format", value_name = "FORMAT")]
    log_format: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent.
    Run {
        #[command(flatten)]
        common: Common,
        /// Kubernetes YAML (Services, EndpointSlices, Nodes, ServiceCIDRs) to proxy instead of
        /// an API server, re-read when it changes.
        #[arg(long)]
        from_file: Option<PathBuf>,
        /// kubeconfig of the API server (default: the config's clientConnection.kubeconfig,
        /// else the in-cluster service account, else $KUBECONFIG or ~/.kube/config).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// The API server's address, e.g. https://192.0.2.10:6443 (replaces the kubeconfig's
        /// server; without a kubeconfig, the in-cluster service account's token and CA are
        /// used with it).
        #[arg(long)]
        master: Option<String>,
        /// Sync once, then exit (rules stay in place).
        #[arg(long)]
        once: bool,
    },
    /// Print the ruleset that would be programmed, as nft text (needs no privileges).
    Render {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        from_file: PathBuf,
    },
    /// Explain what the rules do with the first packet of a connection.
    Trace {
        #[command(flatten)]
        common: Common,
        #[arg(long)]
        from_file: PathBuf,
        /// Source address of the packet.
        #[arg(long)]
        src: IpAddr,
        /// Destination address and port, e.g. 172.30.0.10:80 or [fd00::10]:80.
        #[arg(long)]
        dst: SocketAddr,
        #[arg(long, default_value = "tcp", value_parser = parse_proto)]
        proto: Proto,
        /// An address of this node, in addition to the Node object's (repeatable); packets
        /// from these addresses are traced through the output hooks.
        #[arg(long = "local-address")]
        local_addresses: Vec<IpAddr>,
    },
    /// Remove everything nftproxy created: its nftables tables and its iptables chains (both
    /// the legacy and the nft variant).
    Cleanup {
        /// Instead remove only kube-proxy's leftovers (nftproxy's rules stay, so this is safe
        /// on a node nftproxy serves): its nftables tables (`ip kube-proxy`,
        /// `ip6 kube-proxy`) and its iptables chains (`KUBE-SERVICES`, `KUBE-SVC-...`; not
        /// kubelet's), in both variants.
        #[arg(long)]
        kube_proxy: bool,
    },
    /// Build a throwaway lab of network namespaces, program an example cluster into it, send
    /// traffic through its Services and show what happened (needs root).
    Demo,
    /// The demo's echo server (runs inside the demo's pods).
    #[command(hide = true)]
    DemoEcho {
        #[arg(long)]
        name: String,
        /// The lab this server belongs to (lets leftover checks find it).
        #[arg(long)]
        lab: String,
        #[arg(long, value_delimiter = ',')]
        ports: Vec<u16>,
    },
}

fn parse_proto(s: &str) -> Result<Proto, String> {
    match s.to_ascii_lowercase().as_str() {
        "tcp" => Ok(Proto::Tcp),
        "udp" => Ok(Proto::Udp),
        "sctp" => Ok(Proto::Sctp),
        _ => Err(format!("{s:?} is not tcp, udp or sctp")),
    }
}

/// An error with the process exit status it maps to.
struct Failure {
    code: u8,
    message: String,
}

fn usage(message: impl ToString) -> Failure {
    Failure {
        code: 2,
        message: message.to_string(),
    }
}

fn runtime(message: impl ToString) -> Failure {
    Failure {
        code: 1,
        message: message.to_string(),
    }
}

/// Reads the configuration, starts logging as it says, and logs its warnings.
fn settings(common: &Common, api: Option<&ApiFlags>) -> Result<Settings, Failure> {
    let file = match &common.config {
        Some(path) => KubeProxyConfiguration::load(path).map_err(usage)?,
        None => KubeProxyConfiguration::default(),
    };
    let overrides = Overrides {
        hostname_override: common.hostname_override.clone(),
        proxy_mode: common.proxy_mode.clone(),
        kubeconfig: api
            .and_then(|a| a.kubeconfig.as_ref())
            .map(|p| p.display().to_string()),
        master: api.and_then(|a| a.master.clone()),
        verbosity: common.verbosity,
        log_format: common.log_format.clone(),
    };
    let settings = Settings::resolve(&file, &overrides).map_err(usage)?;
    init_logging(settings.logging.format, settings.logging.verbosity);
    // Without a file nothing was asked that nftproxy does differently.
    if common.config.is_some() {
        for w in &settings.warnings {
            tracing::warn!(field = %w.field, "{}", w.message);
        }
    }
    Ok(settings)
}

/// `run`'s API server flags.
struct ApiFlags {
    kubeconfig: Option<PathBuf>,
    master: Option<String>,
}

fn load(path: &Path, settings: &mut Settings) -> Result<Cluster, Failure> {
    let (cluster, skipped) = source::load_file(path, &settings.node_name, "").map_err(usage)?;
    source::report_skipped(&skipped);
    settings.build.local_addresses = nftproxy::addresses::local_addresses();
    Ok(cluster)
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The API client, and what to say when its server cannot be reached.
fn kube_client(
    rt: &tokio::runtime::Runtime,
    settings: &Settings,
) -> Result<(kube::Client, watch::Diagnosis), Failure> {
    let request = apiclient::Request {
        flag_kubeconfig: None,
        config_kubeconfig: settings.kubeconfig.as_ref().map(PathBuf::from),
        master: settings.master.clone(),
    };
    let target = rt.block_on(apiclient::resolve(&request)).map_err(usage)?;
    let kubernetes_ip = apiclient::kubernetes_service_ip(|k| std::env::var(k).ok());
    if let Some(problem) =
        apiclient::cluster_ip_problem(&target, kubernetes_ip, &Cluster::default())
    {
        tracing::warn!(
            "{problem}; this works only while Service rules are in place (not on a new or rebooted node, nor after `nftproxy cleanup`)"
        );
    }
    tracing::info!(server = %target.server(), origin = ?target.origin, "API server");
    // The client's buffer task is spawned on the runtime.
    let _runtime = rt.enter();
    // Timeouts, keepalive, the watch watchdog and lists from the watch cache, with the next page
    // of a list asked for as soon as a page arrives; what the stack sees of the server
    // (answers, Retry-After) goes to the watchers through the diagnosis.
    let liveness = Arc::new(apiclient::Liveness::default());
    let layer = nftproxy::client_metrics::ClientMetricsLayer::new(&target.config.cluster_url);
    let client = apiclient::client_builder(&target.config, liveness.clone())
        .map_err(|e| runtime(format!("API client: {e}")))?
        .with_layer(&nftproxy::prefetch::PrefetchLayer)
        .with_layer(&layer)
        .with_layer(&nftproxy::ratelimit::RateLimitLayer::new(
            settings.client.qps,
            settings.client.burst,
        ))
        .build();
    let diagnosis = watch::Diagnosis::new(move |cluster| {
        apiclient::cluster_ip_problem(&target, kubernetes_ip, cluster)
    })
    .with_liveness(liveness);
    Ok((client, diagnosis))
}

/// Follows a YAML file: re-reads it into the tracker whenever its modification time changes.
fn follow_file(shared: Arc<Shared>, path: PathBuf) {
    let mut seen = modified(&path);
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let now = modified(&path);
        if now == seen {
            continue;
        }
        seen = now;
        match shared.with_tracker(|t| source::load_into(t, &path)) {
            Ok(()) => {
                nftproxy::memory::release_freed();
                shared.changed()
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot read the file; keeping the previous rules")
            }
        }
    }
}

/// Wakes the sync loop whenever this host's addresses change, so NodePort addresses follow.
fn watch_addresses(shared: Arc<Shared>) {
    addresses::follow(shared.local_addresses(), || {
        tracing::info!("local addresses changed");
        shared.wake(Wake::Addresses);
    });
}

/// Wakes the sync loop whenever someone else changes nftproxy's tables.
fn monitor_drift(shared: Arc<Shared>, mut monitor: Monitor) {
    loop {
        match monitor.wait() {
            Ok(event) => {
                // Let the foreign change finish, then repair once for all of it: a large one
                // (deleting a big table) keeps notifying for a while. Bounded, in case changes
                // never stop.
                for _ in 0..20 {
                    std::thread::sleep(Duration::from_millis(100));
                    if monitor.drain() == 0 {
                        break;
                    }
                }
                tracing::warn!(
                    ?event,
                    "nftproxy's tables were changed by someone else; repairing"
                );
                shared.wake(Wake::Drift);
            }
            Err(e) => {
                tracing::warn!(error = %e, "nftables change monitor failed");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
}

/// Subscribes to nf_tables change notifications for [`monitor_drift`], and lets `syncer`
/// pause them around its own large transactions.
fn start_drift_monitor(shared: &Arc<Shared>, syncer: &mut Syncer) {
    let Some(portid) = syncer.portid() else {
        return;
    };
    let monitor = match Monitor::open(portid) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch nftables changes; drift is repaired by periodic full syncs only");
            return;
        }
    };
    let waker = shared.clone();
    syncer.set_quieter(monitor.quieter(move || {
        tracing::info!("the ruleset changed while change notifications were paused; checking");
        waker.wake(Wake::Drift);
    }));
    let shared = shared.clone();
    std::thread::spawn(move || monitor_drift(shared, monitor));
}

/// iptables mode: wakes the sync loop for a full sync when nftproxy's canary chains are gone
/// (someone flushed the tables), checked every `syncPeriod` like kube-proxy's
/// `KUBE-PROXY-CANARY`.
fn monitor_canary(shared: Arc<Shared>, variant: iptables::Variant, period: Duration) {
    // Only a canary that was there and went away counts (the first sync creates it).
    let mut seen = false;
    loop {
        std::thread::sleep(period);
        match iptables::canary_present(variant) {
            Some(true) => seen = true,
            Some(false) if seen => {
                tracing::warn!("nftproxy's iptables canary chains are gone; restoring all rules");
                shared.wake(Wake::Drift);
                seen = false;
            }
            _ => {}
        }
    }
}

fn run(
    common: &Common,
    from_file: Option<&Path>,
    api: &ApiFlags,
    once: bool,
) -> Result<(), Failure> {
    let settings = settings(common, Some(api))?;
    apply_oom_score_adj(settings.oom_score_adj);
    let (shared, rx) = Shared::new(Tracker::new(&settings.node_name, ""));
    let shared = Arc::new(shared);
    // One worker: its tasks wait on the network (watches, list pages, the HTTP endpoints) and
    // convert objects, while syncs run on a thread of their own. A second worker only took CPU
    // from whatever shares the node: beside an API server on two CPUs, it made a cold start's
    // lists 1.3× slower (docs/performance.md, "Live mode").
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(runtime)?;
    match from_file {
        Some(path) => {
            shared
                .with_tracker(|t| source::load_into(t, path))
                .map_err(usage)?;
            if !once {
                nftproxy::memory::release_freed();
            }
        }
        None => {
            let (client, diagnosis) = kube_client(&rt, &settings)?;
            rt.spawn(watch::run(
                client,
                settings.node_name.clone(),
                shared.clone(),
                Arc::new(diagnosis),
            ));
        }
    }
    // Files are complete as they are; from the API, the first sync waits for the Node.
    let node_wait = NodeWait::new(
        &settings.node_name,
        from_file.is_none().then_some(NODE_WAIT),
        settings.bind_address,
    );
    let mut syncer = Syncer::for_mode(settings.mode, &settings.iptables).map_err(runtime)?;
    // Switching modes: what the other backend programmed goes (kube-proxy does the same).
    syncer.remove_other_backend();
    if once {
        let result = syncloop::once(&shared, &settings, &mut syncer, node_wait, &mut SystemClock);
        // The process exits next, which frees everything at once: freeing the cluster, the
        // tracker and the committed state one allocation at a time first costs a few hundred
        // milliseconds at 30,000 Services.
        std::mem::forget(shared);
        std::mem::forget(syncer);
        return result.map_err(runtime);
    }
    if let Some(path) = from_file {
        let (shared, path) = (shared.clone(), path.to_path_buf());
        std::thread::spawn(move || follow_file(shared, path));
    }
    start_drift_monitor(&shared, &mut syncer);
    {
        let shared = shared.clone();
        std::thread::spawn(move || watch_addresses(shared));
    }
    if let Some(variant) = syncer.iptables_variant() {
        let (shared, period) = (shared.clone(), settings.sync_period);
        std::thread::spawn(move || monitor_canary(shared, variant, period));
    }
    // Metrics, /healthz and /livez, health-check node ports.
    let telemetry = nftproxy::telemetry::Telemetry::start(rt.handle(), &settings, shared.clone())
        .map_err(usage)?;
    shared.changed();
    {
        let shared = shared.clone();
        let settings = settings.clone();
        std::thread::spawn(move || {
            let mut observer = telemetry;
            syncloop::run(
                &shared,
                rx,
                &settings,
                &mut syncer,
                &mut observer,
                node_wait,
                &mut SystemClock,
            )
        });
    }
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(runtime)?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: exiting; the rules stay in place"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: exiting; the rules stay in place"),
        }
        Ok::<(), Failure>(())
    })?;
    Ok(())
}

/// Writes to stdout; a closed pipe (`nftproxy render | head`) is not an error.
fn print_out(text: &str) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(runtime(e)),
        _ => Ok(()),
    }
}

fn render_cmd(common: &Common, from_file: &Path) -> Result<(), Failure> {
    let mut settings = settings(common, None)?;
    let cluster = load(from_file, &mut settings)?;
    if settings.mode == ProxyMode::Iptables {
        // The input of a first (full) restore, per family.
        let text: String = Family::ALL
            .iter()
            .map(|f| {
                let rules =
                    dataplane::iptables::build(&cluster, &settings.build, &settings.iptables, *f);
                let restore = dataplane::iptables::plan_full(&rules, &Default::default());
                format!(
                    "# {}tables-restore --noflush\n{}",
                    if *f == Family::V6 { "ip6" } else { "ip" },
                    restore.text
                )
            })
            .collect();
        return print_out(&text);
    }
    let text: String = Family::ALL
        .iter()
        .map(|f| render::table_text(&build(&cluster, &settings.build, *f).table))
        .collect();
    print_out(&text)
}

fn trace_cmd(
    common: &Common,
    from_file: &Path,
    pkt: Packet,
    extra_local: &[IpAddr],
) -> Result<(), Failure> {
    let settings = settings(common, None)?;
    if settings.mode == ProxyMode::Iptables {
        return Err(usage(
            "trace explains the nftables ruleset; it does not model iptables mode",
        ));
    }
    let (cluster, skipped) =
        source::load_file(from_file, &settings.node_name, "").map_err(usage)?;
    source::report_skipped(&skipped);
    let mut local_addresses: Vec<IpAddr> = extra_local.to_vec();
    if let Some(node) = &cluster.node {
        local_addresses.extend(node.addresses.iter().copied());
    }
    let family = Family::of(&pkt.src);
    if family != Family::of(&pkt.dst.ip()) {
        return Err(usage("--src and --dst must be of the same IP family"));
    }
    let built = build(&cluster, &settings.build, family);
    let host = Host { local_addresses };
    let mut result = trace(&built.table, &host, &pkt);
    result.name_services(&cluster, family);
    print_out(&nftproxy::explain::explain(&pkt, &host, &result))
}

/// Starts logging to stderr, once: text or JSON lines, at klog-style verbosity (RUST_LOG, when
/// set, wins).
fn init_logging(format: LogFormat, verbosity: u32) {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        // kube's client logs every failed request itself; the watchers report failures once
        // per outage instead (see watch.rs).
        let default = match verbosity {
            0..=1 => "info,kube_client=off",
            2..=3 => "info,nftproxy=debug,kube_client=off",
            _ => "debug,nftproxy=trace",
        };
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
        let builder = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(filter);
        match format {
            LogFormat::Json => builder.json().flatten_event(true).init(),
            LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        }
    });
}

/// Lowers the chance the kernel's OOM killer picks the agent (kube-proxy's `oomScoreAdj`,
/// -999 by default): a node without its Service proxy loses every Service.
fn apply_oom_score_adj(value: i32) {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        tracing::warn!(value, error = %e, "cannot set oomScoreAdj");
    }
}

/// The agent's allocator, with its settings made in `main` ([`nftproxy::memory`]).
#[global_allocator]
static ALLOCATOR: nftproxy::memory::Allocator = nftproxy::memory::Allocator {};

/// A panic in any thread ends the process, with the panic in the log, so that the kubelet
/// restarts the agent: a dead sync thread or watcher behind live health endpoints would leave
/// the rules stale without anyone noticing. The rules stay in place meanwhile.
fn exit_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        tracing::error!(panic = %info, "panicked; exiting so that nftproxy is restarted (the rules stay in place)");
        std::process::exit(70);
    }));
}

fn main() -> ExitCode {
    nftproxy::memory::configure();
    exit_on_panic();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Cleanup { .. } | Command::Demo | Command::DemoEcho { .. }
    ) {
        init_logging(LogFormat::Text, 0);
    }
    let result = match &cli.command {
        Command::Run {
            common,
            from_file,
            kubeconfig,
            master,
            once,
        } => run(
            common,
            from_file.as_deref(),
            &ApiFlags {
                kubeconfig: kubeconfig.clone(),
                master: master.clone(),
            },
            *once,
        ),
        Command::Render { common, from_file } => render_cmd(common, from_file),
        Command::Trace {
            common,
            from_file,
            src,
            dst,
            proto,
            local_addresses,
        } => trace_cmd(
            common,
            from_file,
            Packet {
                src: *src,
                dst: *dst,
                proto: *proto,
                iif: None,
            },
            local_addresses,
        ),
        Command::Demo => std::env::current_exe()
            .map_err(runtime)
            .and_then(|bin| nftproxy::demo::run(&bin).map_err(runtime))
            .and_then(|text| print_out(&text)),
        Command::DemoEcho { name, ports, .. } => {
            nftproxy::demo::echo_serve(name, ports).map_err(runtime)
        }
        Command::Cleanup { kube_proxy } => proxier::cleanup_all(*kube_proxy).map_err(runtime),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("nftproxy: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
