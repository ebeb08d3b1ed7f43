//! `nftproxy`: the node agent and its tools.

use std::io::{IsTerminal, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand};
use dataplane::build::build;
use dataplane::model::Cluster;
use dataplane::render;
use dataplane::ruleset::{Family, Proto};
use dataplane::trace::{Host, Packet, trace};
use nftproxy::config::{KubeProxyConfiguration, Overrides, Settings};
use nftproxy::source;
use nftproxy::sync::Syncer;

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
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent.
    Run {
        #[command(flatten)]
        common: Common,
        /// Kubernetes YAML (Services, EndpointSlices, Nodes, ServiceCIDRs) to proxy, re-read
        /// when it changes.
        #[arg(long)]
        from_file: PathBuf,
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
    /// Remove everything nftproxy created.
    Cleanup,
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

fn settings(common: &Common) -> Result<Settings, Failure> {
    let file = match &common.config {
        Some(path) => KubeProxyConfiguration::load(path).map_err(usage)?,
        None => KubeProxyConfiguration::default(),
    };
    for field in file.ignored_fields() {
        tracing::warn!(field, "configuration field is not used by nftproxy");
    }
    let overrides = Overrides {
        hostname_override: common.hostname_override.clone(),
        proxy_mode: common.proxy_mode.clone(),
    };
    let settings = Settings::resolve(&file, &overrides).map_err(usage)?;
    if settings.mode != nftproxy::config::ProxyMode::Nftables {
        return Err(usage("mode: only \"nftables\" is available in this build"));
    }
    Ok(settings)
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

fn run(common: &Common, from_file: &Path, once: bool) -> Result<(), Failure> {
    let mut settings = settings(common)?;
    let mut cluster = load(from_file, &mut settings)?;
    let mut syncer = Syncer::new().map_err(runtime)?;
    syncer
        .sync(&cluster, &settings.build, true)
        .map_err(runtime)?;
    if once {
        return Ok(());
    }
    // Follow the file: re-sync when it changes, retry after syncPeriod when a sync fails.
    let mut seen = modified(from_file);
    let mut failed = false;
    loop {
        std::thread::sleep(if failed {
            settings.sync_period
        } else {
            settings.min_sync_period.max(Duration::from_millis(200))
        });
        let now = modified(from_file);
        if now == seen && !failed {
            continue;
        }
        seen = now;
        match load(from_file, &mut settings) {
            Ok(c) => cluster = c,
            Err(e) => {
                tracing::error!(error = %e.message, "keeping the previous rules");
                continue;
            }
        }
        match syncer.sync(&cluster, &settings.build, failed) {
            Ok(_) => failed = false,
            Err(e) => {
                tracing::error!(error = %e, retry_in = ?settings.sync_period, "sync failed");
                failed = true;
            }
        }
    }
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
    let mut settings = settings(common)?;
    let cluster = load(from_file, &mut settings)?;
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
    let settings = settings(common)?;
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
    let result = trace(&built.table, &host, &pkt);
    print_out(&nftproxy::explain::explain(&pkt, &host, &result))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Run {
            common,
            from_file,
            once,
        } => run(common, from_file, *once),
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
        Command::Cleanup => Syncer::new().and_then(|mut s| s.cleanup()).map_err(runtime),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("nftproxy: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
