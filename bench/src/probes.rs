//! Partial syncs by Service shape (issue 20, item 2): what an endpoint change, a Service added
//! or deleted, and a Service crossing an endpoint-count boundary cost at scale, for Services of
//! 1 to 5,000 endpoints, with and without ClientIP affinity, and for LoadBalancer Services of
//! two TCP ports (a list per port and frontend once; now one list the ports and frontends
//! share, docs/architecture.md).
//!
//! The generic partial syncs of `measure.rs` change a Service picked by index, which in the
//! realistic shape is most often one with 1–3 endpoints. Here probe Services of exactly the
//! shape being measured are added to the cluster before its cold sync (so the cluster is the
//! same plus ten Services), and each change is synced through the agent's `Syncer` with the
//! changed Service's name, as the agent's tracker reports it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::time::Instant;

use anyhow::{Context, Result};
use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::{BuildConfig, LIST_MAX_ENDPOINTS};
use dataplane::nft::ruleset::Family;
use nftproxy::proxier::{ChangedServices, Phase, Probe, Syncer};
use serde::Serialize;

use crate::drift;
use crate::measure::{median, ms};
use crate::netns::Netns;
use crate::realistic;
use crate::synth::{self, Spec};

/// The endpoint counts measured.
pub const ENDPOINTS: [usize; 5] = [1, 20, 200, 1000, 5000];

/// The endpoint counts measured on two-port LoadBalancer Services.
pub const LB_ENDPOINTS: [usize; 3] = [200, 1000, 5000];

/// The Service shapes measured: ClusterIP Services of one port by endpoint count, without
/// and with ClientIP affinity, then the LoadBalancer Services.
pub fn shapes() -> Vec<Shape> {
    let cluster_ip = [false, true].into_iter().flat_map(|affinity| {
        ENDPOINTS.map(|endpoints| Shape {
            endpoints,
            affinity,
            load_balancer: false,
        })
    });
    let lb = LB_ENDPOINTS.map(|endpoints| Shape {
        endpoints,
        affinity: false,
        load_balancer: true,
    });
    cluster_ip.chain(lb).collect()
}

/// A probe Service's shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub endpoints: usize,
    pub affinity: bool,
    /// A LoadBalancer with two ports (a ClusterIP Service of one port otherwise).
    pub load_balancer: bool,
}

impl Shape {
    /// The probe's label: "20 endpoints, ClientIP", "1000 endpoints, LoadBalancer, 2 ports".
    pub fn label(self) -> String {
        let lb = if self.load_balancer {
            ", LoadBalancer, 2 ports"
        } else {
            ""
        };
        format!("{}{lb}", label(self.endpoints, self.affinity))
    }
}

/// The operations measured on each probe, in the order shown.
pub const OPS: [&str; 4] = [
    "endpoint added",
    "endpoint removed",
    "Service added",
    "Service deleted",
];

/// One operation on one probe shape: medians and worst over the repetitions (after one
/// unrecorded warm-up round).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProbeOp {
    pub median_ms: f64,
    pub max_ms: f64,
    /// Median of the commits' part of each sync (encoding, the kernel, its answer).
    pub commit_ms: f64,
    /// Netlink messages and planned operations (both families), medians.
    pub messages: usize,
    pub ops: usize,
    pub runs_ms: Vec<f64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ProbeResult {
    /// Cold full sync of the cluster with the probes (both families), in this namespace.
    pub cold_ms: f64,
    /// By probe ("20 endpoints, ClientIP", "boundary 16 <-> 17"), then by operation.
    pub probes: BTreeMap<String, BTreeMap<String, ProbeOp>>,
    /// The probes in the order measured (the map above is sorted by name).
    pub order: Vec<String>,
}

/// The probe label of a shape.
fn label(endpoints: usize, affinity: bool) -> String {
    let plural = if endpoints == 1 { "" } else { "s" };
    let aff = if affinity { ", ClientIP" } else { "" };
    format!("{endpoints} endpoint{plural}{aff}")
}

/// The boundaries measured: (label, endpoints before, operation names up and down). The
/// lists' limit (above it the flat path), none, and two powers of two at which a large
/// Service's destination moves from one class to the next (`big-class-J`).
pub fn boundaries() -> Vec<(String, usize, [String; 2])> {
    let edge = |k: usize| {
        (
            format!("boundary {k} <-> {}", k + 1),
            k,
            [format!("{k} -> {}", k + 1), format!("{} -> {k}", k + 1)],
        )
    };
    vec![edge(LIST_MAX_ENDPOINTS), edge(0), edge(1024), edge(4096)]
}

/// Hands out probe Services beyond the cluster's: indices from `n + 100000` (the generic
/// partial syncs use `n + rep`), pod addresses from `10.192.0.0` (the clusters' run from
/// `10.64.0.0`; extra endpoints come from `10.250.0.0`).
struct Alloc {
    next_index: usize,
    next_endpoint: u32,
    next_extra: u32,
}

impl Alloc {
    fn new(n: usize) -> Alloc {
        Alloc {
            next_index: n + 100_000,
            next_endpoint: 0x0080_0000,
            next_extra: 0,
        }
    }

    fn spec(&mut self, endpoints: usize, affinity: bool) -> Spec {
        let spec = realistic::probe(self.next_index, endpoints, affinity, self.next_endpoint);
        self.next_index += 1;
        self.next_endpoint += endpoints as u32;
        spec
    }

    /// A probe of `shape`; a LoadBalancer's two node ports start at `node_ports`.
    fn shaped(&mut self, shape: Shape, node_ports: u16) -> Spec {
        let spec = self.spec(shape.endpoints, shape.affinity);
        if shape.load_balancer {
            realistic::load_balancer(spec, node_ports)
        } else {
            spec
        }
    }

    fn extra_endpoint(&mut self) -> Ipv4Addr {
        self.next_extra += 1;
        Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 250, 0, 0)) + self.next_extra)
    }
}

struct Run {
    wall_ms: f64,
    /// Of `wall_ms`, the commits: encoding the batch, the kernel's work, its answer.
    commit_ms: f64,
    messages: usize,
    ops: usize,
}

/// The wall time a sync spends committing ([`Phase::Commit`]), read with the clock alone: a
/// probe's sync takes tens of microseconds, which CPU-time system calls would distort.
#[derive(Default)]
struct CommitClock {
    since: Option<Instant>,
    commit_ms: f64,
}

impl Probe for CommitClock {
    fn enter(&mut self, _: Family, phase: Phase) {
        let now = Instant::now();
        if let Some(since) = self.since.take() {
            self.commit_ms += ms(now - since);
        }
        if phase == Phase::Commit {
            self.since = Some(now);
        }
    }
}

/// One sync of both families: full (through `Syncer::sync_families`, which may sync the
/// families at once), or partial for `changed` (each family in turn, as the `Syncer` does,
/// with the commits timed).
fn timed_sync(
    syncer: &mut Syncer,
    cluster: &Cluster,
    config: &BuildConfig,
    changed: Option<&BTreeSet<ObjectName>>,
) -> Result<Run> {
    let mut run = Run {
        wall_ms: 0.0,
        commit_ms: 0.0,
        messages: 0,
        ops: 0,
    };
    let Some(changed) = changed else {
        let both = Family::ALL.iter().map(|f| (*f, true)).collect();
        let t = Instant::now();
        let results = syncer.sync_families(cluster, config, &both, ChangedServices::All);
        run.wall_ms = ms(t.elapsed());
        for (family, r) in results {
            let r = r.with_context(|| format!("{family:?} sync"))?;
            run.messages += r.messages;
            run.ops += r.ops;
        }
        return Ok(run);
    };
    let mut clock = CommitClock::default();
    let t = Instant::now();
    for family in Family::ALL {
        let Some(proxier) = syncer.proxier(family) else {
            continue;
        };
        let changed = ChangedServices::Services(changed);
        let r = proxier
            .sync(cluster, config, false, changed, &mut clock)
            .with_context(|| format!("{family:?} sync"))?;
        run.messages += r.messages;
        run.ops += r.ops;
    }
    run.wall_ms = ms(t.elapsed());
    run.commit_ms = clock.commit_ms;
    Ok(run)
}

/// Pairs of consecutive node ports (the first of each) no Service of `cluster` uses, from the
/// top of the range down: the realistic shape hands them out from 30000 up.
fn free_node_port_pairs(cluster: &Cluster) -> Vec<u16> {
    let used: BTreeSet<u16> = cluster
        .services
        .values()
        .flat_map(|svc| svc.ports.iter().filter_map(|p| p.node_port))
        .collect();
    (30000..u16::MAX)
        .rev()
        .step_by(2)
        .filter(|p| !used.contains(p) && !used.contains(&(p + 1)))
        .collect()
}

fn add_service(cluster: &mut Cluster, spec: &Spec) -> Result<()> {
    let mut objects = vec![spec.service()];
    objects.extend(spec.slices());
    synth::add_to_cluster(cluster, &objects)
}

/// Records the runs of one operation, dropping the warm-up round.
#[derive(Default)]
struct Recorder {
    runs: BTreeMap<(String, String), Vec<Run>>,
}

impl Recorder {
    fn add(&mut self, probe: &str, op: &str, rep: usize, run: Run) {
        if rep >= WARM_UP {
            self.runs
                .entry((probe.to_string(), op.to_string()))
                .or_default()
                .push(run);
        }
    }

    fn finish(self, out: &mut ProbeResult) {
        for ((probe, op), runs) in self.runs {
            let med = |g: fn(&Run) -> f64| median(runs.iter().map(g).collect());
            let entry = ProbeOp {
                median_ms: med(|r| r.wall_ms),
                commit_ms: med(|r| r.commit_ms),
                max_ms: runs.iter().map(|r| r.wall_ms).fold(0.0, f64::max),
                messages: med(|r| r.messages as f64) as usize,
                ops: med(|r| r.ops as f64) as usize,
                runs_ms: runs.iter().map(|r| r.wall_ms).collect(),
            };
            out.probes.entry(probe).or_default().insert(op, entry);
        }
    }
}

const WARM_UP: usize = 1;

/// Adds the probes to `cluster` (of `n` Services), cold-syncs it in a fresh namespace, then
/// measures each operation `reps` times after a warm-up round.
pub fn probe_bench(
    ns_label: &str,
    cluster: &Cluster,
    config: &BuildConfig,
    n: usize,
    reps: usize,
) -> Result<ProbeResult> {
    let ns = Netns::create(ns_label)?;
    ns.run_in(|| {
        let mut config = config.clone();
        config.local_addresses = nftproxy::addresses::local_addresses();
        let mut cluster = cluster.clone();
        let mut alloc = Alloc::new(n);
        let mut out = ProbeResult::default();
        let shapes = shapes();
        // Two node ports for each resident LoadBalancer probe, and two its added copies share
        // (each is deleted before the next comes).
        let mut pairs = free_node_port_pairs(&cluster).into_iter();
        let mut pair = || {
            pairs
                .next()
                .context("no two free node ports left for a probe")
        };
        let copies_node_ports = pair()?;
        let residents: Vec<(String, Spec)> = shapes
            .iter()
            .map(|&shape| Ok((shape.label(), alloc.shaped(shape, pair()?))))
            .collect::<Result<_>>()?;
        let edges: Vec<_> = boundaries()
            .into_iter()
            .map(|(name, k, ops)| (name, alloc.spec(k, false), ops))
            .collect();
        for (_, spec) in &residents {
            add_service(&mut cluster, spec)?;
        }
        for (_, spec, _) in &edges {
            add_service(&mut cluster, spec)?;
        }
        let (mut syncer, _monitor) = drift::daemon_syncer()?;
        out.cold_ms = timed_sync(&mut syncer, &cluster, &config, None)
            .context("cold sync")?
            .wall_ms;

        let mut rec = Recorder::default();
        for (&shape, (name, resident)) in shapes.iter().zip(&residents) {
            out.order.push(name.clone());
            let changed: BTreeSet<ObjectName> = [resident.object_name()].into();
            for rep in 0..WARM_UP + reps {
                let addr = alloc.extra_endpoint();
                synth::add_endpoint(&mut cluster, resident, addr)?;
                let run = timed_sync(&mut syncer, &cluster, &config, Some(&changed))
                    .with_context(|| format!("{name}: endpoint added"))?;
                rec.add(name, OPS[0], rep, run);
                synth::remove_endpoint(&mut cluster, resident, addr)?;
                let run = timed_sync(&mut syncer, &cluster, &config, Some(&changed))
                    .with_context(|| format!("{name}: endpoint removed"))?;
                rec.add(name, OPS[1], rep, run);
            }
            for rep in 0..WARM_UP + reps {
                let spec = alloc.shaped(shape, copies_node_ports);
                let changed: BTreeSet<ObjectName> = [spec.object_name()].into();
                add_service(&mut cluster, &spec)?;
                let run = timed_sync(&mut syncer, &cluster, &config, Some(&changed))
                    .with_context(|| format!("{name}: Service added"))?;
                rec.add(name, OPS[2], rep, run);
                synth::remove_service(&mut cluster, &spec.object_name());
                let run = timed_sync(&mut syncer, &cluster, &config, Some(&changed))
                    .with_context(|| format!("{name}: Service deleted"))?;
                rec.add(name, OPS[3], rep, run);
            }
        }
        for (name, spec, [up, down]) in &edges {
            out.order.push(name.clone());
            let changed: BTreeSet<ObjectName> = [spec.object_name()].into();
            for rep in 0..WARM_UP + reps {
                let addr = alloc.extra_endpoint();
                synth::add_endpoint(&mut cluster, spec, addr)?;
                let run = timed_sync(&mut syncer, &cluster, &config, Some(&changed))
                    .with_context(|| format!("{name}: {up}"))?;
                rec.add(name, up, rep, run);
                synth::remove_endpoint(&mut cluster, spec, addr)?;
                let run = timed_sync(&mut syncer, &cluster, &config, Some(&changed))
                    .with_context(|| format!("{name}: {down}"))?;
                rec.add(name, down, rep, run);
            }
        }
        rec.finish(&mut out);
        Ok(out)
    })
}
