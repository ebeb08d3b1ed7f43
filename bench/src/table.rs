//! The report table: the results of every size, side by side, as text.

use super::*;

// ---------------------------------------------------------------------------------------------
// The table

pub(super) fn short(n: usize) -> String {
    if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    }
}

pub(super) fn f(v: f64) -> String {
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

pub(super) fn mib(bytes: f64) -> String {
    f(bytes / (1024.0 * 1024.0))
}

pub(super) struct Table {
    pub(super) header: Vec<String>,
    pub(super) rows: Vec<Vec<String>>,
}

impl Table {
    pub(super) fn section(&mut self, title: &str) {
        self.rows.push(vec![title.to_string()]);
    }

    pub(super) fn row(&mut self, label: &str, cells: Vec<String>) {
        let mut r = vec![format!("  {label}")];
        r.extend(cells);
        self.rows.push(r);
    }

    pub(super) fn render(&self) -> String {
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

pub(super) fn render(report: &Report, cli: &Cli) -> String {
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

pub(super) fn kib_per_service(mib: f64, services: usize) -> String {
    f(mib * 1024.0 / services as f64)
}

pub(super) fn render_table(sizes: &[&SizeReport], cli: &Cli, shape: Shape) -> String {
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
            "Partial syncs by Service shape (probe Services added to the cluster; each family's partial sync, as Syncer::sync runs them), median / max of {} after a warm-up round, then the commits' median (encoding, the kernel's work, its answer): ms / messages",
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
                            "{} / {} / {} / {}",
                            f(r.median_ms),
                            f(r.max_ms),
                            f(r.commit_ms),
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
