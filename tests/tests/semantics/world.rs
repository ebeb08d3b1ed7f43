//! The lab: the node, its clients and endpoints in network namespaces, and the runs of
//! `nftproxy` that program it.

use super::*;

// ------------------------------------------------------------------------------------------
// The lab.

#[derive(Clone, Copy, Default)]
pub(super) struct Opts {
    /// A namespace outside the node holding the LB IPs (§7.3 "same node to LB, SNATted to LB").
    pub(super) lbsrc: bool,
    /// The second pod ([`POD2`]).
    pub(super) pod2: bool,
    /// Extra client addresses on the pod: 10.0.0.3, 10.0.0.4, ...
    pub(super) extra_clients: u8,
}

pub(super) struct World {
    pub(super) mode: Mode,
    pub(super) lab: Lab,
    pub(super) node: Ns,
    pub(super) ext: Ns,
    pub(super) pod: Ns,
    pub(super) pod2: Option<Ns>,
    pub(super) lbsrc: Option<Ns>,
    /// Holds every endpoint address; a client only for hairpin flows.
    pub(super) eps: Ns,
    pub(super) dir: PathBuf,
    /// Every address of the node namespace (the tracer's and the builder's local addresses).
    pub(super) node_addrs: Vec<IpAddr>,
    /// Tables built from the files of the last [`World::apply`], per family.
    pub(super) tables: BTreeMap<Family, Table>,
    pub(super) errors: Mutex<Vec<String>>,
    pub(super) case: String,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(super) fn addresses(ns: &Ns) -> Vec<IpAddr> {
    let out = ns.exec(&["ip", "-j", "addr", "show"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str().and_then(|s| s.parse().ok()))
        .collect()
}

pub(super) fn world(mode: Mode, opts: Opts) -> World {
    assert!(
        nftproxy_tests::privilege::is_root(),
        "namespace tests need root"
    );
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let ext = lab
        .external(
            &node,
            "ext",
            &[ip(EXT), ip(EXT_BLOCKED), ip(EXT6)],
            &[ip(NODE_IP), ip(NODE_IP6)],
        )
        .unwrap();
    let up = ext.node_link().unwrap().to_string();
    // A real node has default routes: without them, Service addresses nothing translates would
    // be refused by routing before the filter hooks see them.
    // The pod links only have link-scoped gateway addresses, so masquerade towards a pod picks
    // the first global address of the first device (IPv4: lo comes first) or the best match
    // by RFC 6724 (IPv6: same label as the ULA pod addresses): MASQ_IP / MASQ_IP6.
    node.ip_batch(&[
        format!("route add default dev {up}"),
        format!("route add ::/0 dev {up}"),
        format!("addr add {NODE_ALT}/32 dev {up}"),
        format!("addr add {NODE_EXTERNAL_IP}/32 dev {up}"),
        format!("addr add {NODE_ALT6}/128 dev {up} nodad"),
        format!("addr add {MASQ_IP}/32 dev lo"),
        format!("addr add {MASQ_IP6}/128 dev lo nodad"),
    ])
    .unwrap();
    let mut pod_ips = vec![ip(POD), ip(POD6)];
    for i in 0..opts.extra_clients {
        pod_ips.push(IpAddr::from([10, 0, 0, 3 + i]));
    }
    let pod = lab.pod(&node, "pod", &pod_ips).unwrap();
    let pod2 = opts
        .pod2
        .then(|| lab.pod(&node, "pod2", &[ip(POD2)]).unwrap());
    let ep_ips: Vec<IpAddr> = ENDPOINT_IPS.iter().map(|s| ip(s)).collect();
    let eps = lab.pod(&node, "eps", &ep_ips).unwrap();
    let lbsrc = opts.lbsrc.then(|| {
        // Traffic the node sent to an LB that comes back SNATted to the LB IP: a host outside
        // the node whose own addresses are the LB IPs, sending to them through the node.
        // Local routing is moved behind a rule that sends its own LB-addressed packets out, and
        // it accepts the answers that carry its own address as source.
        let ns = lab
            .external(&node, "lbsrc", &[ip(LB1), ip(LB2)], &[])
            .unwrap();
        ns.sysctl(&[
            ("net.ipv4.conf.all.accept_local", "1"),
            ("net.ipv4.conf.eth0.accept_local", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.eth0.rp_filter", "0"),
        ])
        .unwrap();
        ns.ip_batch(&[
            format!("route add {NODE_IP} dev eth0"),
            format!("route add default via {NODE_IP} dev eth0"),
            format!("route add default via {NODE_IP} dev eth0 onlink table 100"),
            format!("rule add pref 10 iif lo to {LB1} lookup 100"),
            format!("rule add pref 11 iif lo to {LB2} lookup 100"),
            "rule add pref 100 lookup local".to_string(),
            "rule del pref 0 lookup local".to_string(),
        ])
        .unwrap();
        ns
    });
    lab.echo(&eps, ENDPOINT_PORTS).unwrap();
    lab.echo(&node, NODE_PORTS).unwrap();
    let node_addrs = addresses(&node);
    let dir = std::env::temp_dir().join(format!("nftproxy-semantics-{}", lab.prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    World {
        mode,
        lab,
        node,
        ext,
        pod,
        pod2,
        lbsrc,
        eps,
        dir,
        node_addrs,
        tables: BTreeMap::new(),
        errors: Mutex::new(Vec::new()),
        case: String::new(),
    }
}

/// The `ops=` of each "nftables sync committed" log line (one per family).
pub(super) fn committed_ops(log: &str) -> Vec<usize> {
    log.lines()
        .filter(|l| l.contains("nftables sync committed"))
        .filter_map(|l| {
            l.split("ops=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

pub(super) fn nftproxy(ns: &Ns, args: &[&str]) -> Output {
    let bin =
        target_binary("nftproxy").expect("build nftproxy first (cargo build --workspace --bins)");
    ns.command(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run nftproxy")
}

/// The tracer's answer for a flow and the chains it went through.
pub(super) type Traced = (Fate, Vec<String>);

impl World {
    /// Writes the objects and the configuration, programs the node with
    /// `nftproxy run --once`, and builds the same tables for the tracer.
    pub(super) fn apply(&mut self, case: &str, objects: &Objects, config: &ProxyConfig) {
        self.case = case.to_string();
        let cluster_path = self.dir.join("cluster.yaml");
        let config_path = self.dir.join("config.yaml");
        let config_text = config.to_yaml();
        std::fs::write(&cluster_path, objects.to_yaml()).unwrap();
        std::fs::write(&config_path, &config_text).unwrap();
        let run = || {
            let out = nftproxy(
                &self.node,
                &[
                    "run",
                    "--once",
                    "--proxy-mode",
                    self.mode.name(),
                    "--from-file",
                    cluster_path.to_str().unwrap(),
                    "--config",
                    config_path.to_str().unwrap(),
                ],
            );
            let log = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                out.status.success(),
                "[{case}] nftproxy run --once failed: {log}"
            );
            log
        };
        match self.mode {
            Mode::Nftables => {
                // Each run reads the kernel's table and sends only the difference (a partial
                // update after the first case); a second run must then find nothing left to do.
                let first = committed_ops(&run());
                let again = committed_ops(&run());
                if again.len() != 2 || again.iter().any(|n| *n != 0) {
                    self.fail(format!(
                        "a second identical run sent {again:?} operations (first run: {first:?})"
                    ));
                }
            }
            Mode::Iptables => {
                // A new process restores everything (iptables has no cheap read-back); a
                // second run must leave exactly the same rules.
                run();
                let first = self.listing();
                run();
                let again = self.listing();
                if again != first {
                    self.fail(format!(
                        "a second identical run changed the rules:\n{first}\n---\n{again}"
                    ));
                }
            }
        }
        let file = KubeProxyConfiguration::parse(&config_text).unwrap();
        let overrides = Overrides {
            proxy_mode: Some(self.mode.name().to_string()),
            ..Overrides::default()
        };
        let mut settings = Settings::resolve(&file, &overrides).unwrap();
        settings.build.local_addresses = self.node_addrs.clone();
        let (cluster, skipped) =
            nftproxy::source::load_file(&cluster_path, &settings.node_name, "").unwrap();
        assert!(skipped.is_empty(), "[{case}] skipped objects: {skipped:?}");
        self.tables = Family::ALL
            .iter()
            .map(|f| (*f, build(&cluster, &settings.build, *f).table))
            .collect();
    }

    /// The namespace that owns `src` (the node for node addresses).
    pub(super) fn ns_of(&self, src: IpAddr) -> &Ns {
        if self.node_addrs.contains(&src) {
            return &self.node;
        }
        [
            Some(&self.pod),
            self.pod2.as_ref(),
            Some(&self.ext),
            self.lbsrc.as_ref(),
            Some(&self.eps),
        ]
        .into_iter()
        .flatten()
        .find(|ns| ns.ips().contains(&src))
        .unwrap_or_else(|| panic!("no namespace has {src}"))
    }

    /// Runs `nettest probe` and returns its attempts.
    pub(super) fn attempts(&self, ns: &Ns, probe: &Probe) -> Vec<Attempt> {
        let out = ns
            .command(self.lab.nettest())
            .args(probe.args())
            .output()
            .expect("run nettest probe");
        assert!(
            out.status.success(),
            "nettest probe in {} failed: {}",
            ns.label(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
            .collect()
    }

    /// The kernel's answer for a flow: enough attempts to see every expected endpoint.
    pub(super) fn kernel(&self, f: &Flow) -> Fate {
        let mut fate = self.kernel_once(f);
        // The host's per-CPU packet backlog is shared by every namespace, so a busy machine
        // (other suites, benchmarks) can drop an odd packet: a few timeouts among otherwise
        // expected answers are probed again, twice at most. A real difference is consistent.
        for _ in 0..2 {
            let lossy = match (&fate, f.want(self.mode)) {
                (Fate::Other(_), want) => *want != Fate::Drop,
                _ => false,
            };
            if !lossy {
                break;
            }
            fate = self.kernel_once(f);
        }
        fate
    }

    pub(super) fn kernel_once(&self, f: &Flow) -> Fate {
        let ns = self.ns_of(f.src);
        let mut base = Probe::new(f.proto, f.dst, 1).src(f.src).parallel(8);
        if f.no_udp_checksum {
            base = base.no_udp_checksum();
        }
        let (count, timeout) = match f.want(self.mode) {
            Fate::Endpoints { set, .. } => (8 * set.len().max(1), ANSWER_TIMEOUT),
            Fate::Drop => (3, DROP_TIMEOUT),
            _ => (4, ANSWER_TIMEOUT),
        };
        let mut probe = base.clone().timeout(timeout);
        probe.count = count;
        let mut attempts = self.attempts(ns, &probe);
        // Random choices: top up until every expected endpoint answered (or something else).
        for _ in 0..4 {
            match (
                kernel_fate(&attempts, f.dst, &self.node_addrs),
                f.want(self.mode),
            ) {
                (Fate::Endpoints { set: got, .. }, Fate::Endpoints { set: want, .. })
                    if got != *want && got.is_subset(want) =>
                {
                    probe.count = 16 * want.len();
                    attempts.extend(self.attempts(ns, &probe));
                }
                _ => break,
            }
        }
        kernel_fate(&attempts, f.dst, &self.node_addrs)
    }

    /// The tracer's answer for a flow, and the chains it went through.
    pub(super) fn tracer(&self, f: &Flow) -> (Fate, Vec<String>) {
        let family = Family::of(&f.src);
        let ns = self.ns_of(f.src);
        let iif = (ns != &self.node)
            .then(|| ns.node_link().map(str::to_string))
            .flatten();
        let host = Host {
            local_addresses: self.node_addrs.clone(),
        };
        let pkt = Packet {
            src: f.src,
            dst: f.dst,
            proto: nft_proto(f.proto),
            iif,
        };
        let t = trace(&self.tables[&family], &host, &pkt);
        (tracer_fate(&t.outcomes, f.dst, &self.node_addrs), t.chains)
    }

    /// Checks flows (concurrently); mismatches are collected and reported by [`World::finish`].
    pub(super) fn check(&self, flows: &[Flow]) {
        // The tracer models the nftables ruleset: in iptables mode only the kernel is asked.
        let tracer = |f: &Flow| match self.mode {
            Mode::Nftables => Some(self.tracer(f)),
            Mode::Iptables => None,
        };
        let results: Vec<(Fate, Option<Traced>)> = std::thread::scope(|s| {
            let handles: Vec<_> = flows
                .iter()
                .map(|f| s.spawn(move || (self.kernel(f), tracer(f))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (f, (kernel, traced)) in flows.iter().zip(results) {
            let want = f.want(self.mode);
            let tracer_ok = traced.as_ref().is_none_or(|(t, _)| t == want);
            if kernel != *want || !tracer_ok {
                let why = match (&f.iptables, self.mode) {
                    (Some((_, why)), Mode::Iptables) => format!(" (iptables mode: {why})"),
                    _ => String::new(),
                };
                let (tracer, chains) = match &traced {
                    Some((t, c)) => (t.to_string(), c.join(" > ")),
                    None => (
                        "(not run: it models nftables mode)".to_string(),
                        String::new(),
                    ),
                };
                self.errors.lock().unwrap().push(format!(
                    "[{} {}] {}: {} {} -> {}\n    table:  {}{}\n    kernel: {}\n    tracer: {}\n    tracer chains: {}\n    conntrack:\n{}",
                    self.mode.name(),
                    self.case,
                    f.name,
                    f.proto,
                    f.src,
                    f.dst,
                    want,
                    why,
                    kernel,
                    tracer,
                    chains,
                    self.conntrack(f)
                ));
            }
        }
    }

    /// The node's conntrack entries of a flow's source and original destination (diagnostics).
    pub(super) fn conntrack(&self, f: &Flow) -> String {
        let out = self
            .node
            .run(&[
                "conntrack",
                "-L",
                "-s",
                &f.src.to_string(),
                "-d",
                &f.dst.ip().to_string(),
            ])
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("({e})"));
        let mut text: String = out.lines().map(|l| format!("      {l}\n")).collect();
        for ns in [self.ns_of(f.src), &self.node] {
            let nstat = ns
                .run(&["nstat", "-az"])
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            for l in nstat.lines() {
                let mut it = l.split_whitespace();
                if let (Some(k), Some(v)) = (it.next(), it.next())
                    && v != "0"
                    && (k.contains("Icmp")
                        || k.contains("Drop")
                        || k.contains("Fail")
                        || k.contains("Rst")
                        || k.contains("Retrans"))
                {
                    text.push_str(&format!("      {} {k} {v}\n", ns.label()));
                }
            }
        }
        text
    }

    pub(super) fn fail(&self, message: String) {
        self.errors
            .lock()
            .unwrap()
            .push(format!("[{} {}] {message}", self.mode.name(), self.case));
    }

    pub(super) fn finish(self) {
        self.check_checksums();
        let errors = self.errors.lock().unwrap();
        assert!(
            errors.is_empty(),
            "{} flow(s) disagree:\n{}",
            errors.len(),
            errors.join("\n")
        );
    }

    /// Fails the world if any of its namespaces received a packet with a bad IP, TCP, UDP or
    /// ICMP checksum. A flow may still succeed with one (TCP and UDP probes retry, and a retry
    /// of a translated connection no longer passes the NAT rules), so the counters are what
    /// shows a rule that rewrites a header without fixing its checksum.
    fn check_checksums(&self) {
        let all = [
            Some(&self.node),
            Some(&self.ext),
            Some(&self.pod),
            self.pod2.as_ref(),
            self.lbsrc.as_ref(),
            Some(&self.eps),
        ];
        for ns in all.into_iter().flatten() {
            let nstat = ns.exec(&["nstat", "-asz"]).unwrap();
            for l in nstat.lines() {
                let mut it = l.split_whitespace();
                if let (Some(k), Some(v)) = (it.next(), it.next())
                    && k.ends_with("InCsumErrors")
                    && v != "0"
                {
                    self.fail(format!("{} counted {v} {k}", ns.label()));
                }
            }
        }
    }

    /// nftproxy's rules: its nftables tables, or its iptables chains (nft variant, the one a
    /// fresh namespace gets) as `iptables-save` shows them.
    pub(super) fn listing(&self) -> String {
        match self.mode {
            Mode::Nftables => ["ip", "ip6"]
                .iter()
                .map(|f| {
                    self.node
                        .exec(&["nft", "list", "table", f, "nftproxy"])
                        .unwrap()
                })
                .collect(),
            Mode::Iptables => ["iptables-nft-save", "ip6tables-nft-save"]
                .iter()
                .flat_map(|t| {
                    let out = self.node.exec(&[t]).unwrap();
                    out.lines()
                        .filter(|l| l.contains("NFTPROXY-"))
                        .map(|l| format!("{l}\n"))
                        .collect::<Vec<_>>()
                })
                .collect(),
        }
    }
}
