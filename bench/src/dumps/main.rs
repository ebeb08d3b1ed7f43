//! nftproxy-dumps: `nftproxy run --once --from-file` on kubectl-sized dumps, in every format a
//! user may hand it (`kind: List` as JSON and as YAML, multi-document YAML, a JSON stream of
//! objects): whole-process wall time and peak RSS, each run in a network namespace of its own,
//! for the agent under test and (optionally) a baseline agent in the same invocation, with
//! PASS/FAIL lines against the targets.
//!
//! ```text
//! nftproxy-dumps --agent target/release/nftproxy --baseline /tmp/nftproxy-baseline \
//!     --services 30000 --endpoints 5 --runs 3
//! ```

#[path = "../netns.rs"]
#[allow(dead_code)]
mod netns;
mod objects;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;

use crate::netns::{Netns, TempDir};
use crate::objects::Format;

#[derive(Parser, Debug)]
#[command(name = "nftproxy-dumps", about = "run --once on kubectl-sized dumps")]
struct Args {
    /// The agent under test.
    #[arg(long)]
    agent: PathBuf,
    /// An agent to compare with (for example the last release), run on the same files.
    #[arg(long)]
    baseline: Option<PathBuf>,
    #[arg(long, default_value_t = 30_000)]
    services: usize,
    #[arg(long, default_value_t = 5)]
    endpoints: usize,
    /// Runs per agent and format; the median wall time and the highest peak RSS are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Whole-process wall time target, seconds.
    #[arg(long, default_value_t = 1.5)]
    max_wall_s: f64,
    /// Peak RSS target, MiB.
    #[arg(long, default_value_t = 300.0)]
    max_rss_mib: f64,
    /// Keep the generated dumps in this directory (default: a temporary one, deleted).
    #[arg(long)]
    keep: Option<PathBuf>,
}

/// One `run --once`.
#[derive(Clone, Copy, Debug)]
struct Run {
    wall_s: f64,
    rss_mib: f64,
}

/// Runs `agent run --once --from-file dump` in a fresh namespace; `Err` if it fails.
fn run_once(agent: &Path, dump: &Path, config: &Path, log: &Path) -> Result<Run> {
    let ns = Netns::create("dump")?;
    let mut cmd = ns.command(agent)?;
    cmd.args(["run", "--once", "--from-file"])
        .arg(dump)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?);
    let start = Instant::now();
    let child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let pid = child.id();
    netns::register_child(pid);
    let mut status: libc::c_int = 0;
    // SAFETY: wait4 on our own child, filling locally owned structs. This process holds no
    // dump in memory, so the child's ru_maxrss (which starts from ours: std spawns with vfork)
    // is the child's own peak.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        loop {
            let rc = libc::wait4(pid as libc::pid_t, &mut status, 0, &mut ru);
            if rc == pid as libc::pid_t {
                break ru;
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err).context("wait4");
            }
        }
    };
    let wall_s = start.elapsed().as_secs_f64();
    netns::unregister_child(pid);
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        bail!("exit status {status:#x}: {}", tail.join(" | "));
    }
    Ok(Run {
        wall_s,
        rss_mib: ru.ru_maxrss as f64 / 1024.0,
    })
}

/// Median wall time and highest peak RSS of `runs` runs, or the first failure.
fn measure(
    agent: &Path,
    dump: &Path,
    config: &Path,
    dir: &Path,
    runs: usize,
) -> Result<Run, String> {
    let mut walls = Vec::new();
    let mut rss: f64 = 0.0;
    for _ in 0..runs.max(1) {
        let run =
            run_once(agent, dump, config, &dir.join("agent.log")).map_err(|e| format!("{e:#}"))?;
        walls.push(run.wall_s);
        rss = rss.max(run.rss_mib);
    }
    walls.sort_by(f64::total_cmp);
    Ok(Run {
        wall_s: walls[walls.len() / 2],
        rss_mib: rss,
    })
}

fn show(r: &Result<Run, String>) -> String {
    match r {
        Ok(r) => format!("{:>7.2} s {:>8.1} MiB", r.wall_s, r.rss_mib),
        Err(e) => format!("failed: {}", e.chars().take(60).collect::<String>()),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    netns::install_signal_handler()?;
    netns::remove_stale();
    let temp = TempDir::new()?;
    let dir = match &args.keep {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => temp.path().to_path_buf(),
    };
    let config = dir.join("kube-proxy.yaml");
    std::fs::write(&config, objects::kube_proxy_config())?;
    println!(
        "nftproxy-dumps: run --once --from-file, {} Services x {} endpoints, {} run(s) each \
         (median wall, highest peak RSS)",
        args.services, args.endpoints, args.runs
    );
    let mut failures = 0;
    let mut verdicts = Vec::new();
    for format in Format::ALL {
        let path = dir.join(format.file_name());
        let bytes = objects::write(&path, format, args.services, args.endpoints)?;
        let new = measure(&args.agent, &path, &config, &dir, args.runs);
        let mut line = format!(
            "{:<22} {:>6.1} MB   agent {}",
            format.name(),
            bytes as f64 / 1e6,
            show(&new)
        );
        if let Some(baseline) = &args.baseline {
            let old = measure(baseline, &path, &config, &dir, args.runs);
            line.push_str(&format!("   baseline {}", show(&old)));
            if let (Ok(n), Ok(o)) = (&new, &old) {
                line.push_str(&format!(
                    "   ({:.1}x faster, {:.1}x less memory)",
                    o.wall_s / n.wall_s,
                    o.rss_mib / n.rss_mib
                ));
            }
        }
        println!("{line}");
        if args.keep.is_none() {
            std::fs::remove_file(&path)?;
        }
        let (wall_ok, rss_ok) = match &new {
            Ok(r) => (r.wall_s <= args.max_wall_s, r.rss_mib <= args.max_rss_mib),
            Err(_) => (false, false),
        };
        for (ok, what) in [
            (wall_ok, format!("wall <= {} s", args.max_wall_s)),
            (rss_ok, format!("peak RSS <= {} MiB", args.max_rss_mib)),
        ] {
            failures += usize::from(!ok);
            verdicts.push(format!(
                "{} run --once, {}: {what}",
                if ok { "PASS" } else { "FAIL" },
                format.name()
            ));
        }
    }
    for v in &verdicts {
        println!("{v}");
    }
    drop(temp);
    if failures > 0 {
        bail!("{failures} target(s) missed");
    }
    Ok(())
}
