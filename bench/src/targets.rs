//! Targets: the figures each run is held to, and whether a size report meets them.

use super::*;

// ---------------------------------------------------------------------------------------------
// Targets

pub(super) fn size(sizes: &[SizeReport], n: usize) -> Option<&SizeReport> {
    sizes.iter().find(|s| s.services == n)
}

pub(super) fn v4_cold(s: &SizeReport) -> Option<&Phases> {
    s.phases.as_ref()?.cold.get("IPv4")
}

pub(super) fn partial<'a>(s: &'a SizeReport, op: &str) -> Option<&'a SyncRun> {
    s.syncer.as_ref()?.partial.get(op)
}

/// The slower of an endpoint addition and removal (wall ms), from medians by operation key.
pub(super) fn endpoint_change(medians: &BTreeMap<String, SyncRun>) -> Option<f64> {
    let added = medians.get("endpoint_added")?.wall_ms;
    let removed = medians.get("endpoint_removed")?.wall_ms;
    Some(added.max(removed))
}

/// The targets of one shape, as they are added.
pub(super) struct Targets {
    pub(super) shape: Shape,
    pub(super) out: Vec<Target>,
}

impl Targets {
    pub(super) fn push(&mut self, target: &str, v: Option<(String, bool)>) {
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
    pub(super) fn versus_kube_proxy(&mut self, sizes: &[SizeReport]) {
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
    pub(super) fn endpoint_change_flat(&mut self, sizes: &[SizeReport]) {
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
    pub(super) fn first_packet(&mut self, sizes: &[SizeReport], n: usize) {
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
pub(super) fn uniform_targets(sizes: &[SizeReport], k: usize) -> Vec<Target> {
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
pub(super) fn realistic_targets(sizes: &[SizeReport]) -> Vec<Target> {
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
    for shape in probes::shapes() {
        let name = shape.label();
        t.push(
            &format!(
                "100k: Service with {name}: endpoint added / removed, Service added / deleted <= 1 ms each (medians)"
            ),
            probes
                .and_then(|p| p.probes.get(&name))
                .and_then(|p| op_list(p, &probes::OPS)),
        );
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
pub(super) fn daemon(s: &SizeReport) -> Option<&AgentResult> {
    s.agent.as_ref().filter(|a| a.idle_window_s > 0.0)
}
