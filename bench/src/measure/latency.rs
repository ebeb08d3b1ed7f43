//! First-packet latency through a Service, in network namespaces.

use super::*;

// ---------------------------------------------------------------------------------------------
// First-packet latency

#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyStats {
    pub connections: usize,
    pub failures: usize,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyResult {
    /// Through the ClusterIP with only that Service loaded.
    pub one_service: LatencyStats,
    /// Through the ClusterIP with the N synthetic Services loaded as well.
    pub loaded: LatencyStats,
    /// Straight to the pod (no DNAT), with one and with N Services loaded: the floor.
    pub direct_one_service: LatencyStats,
    pub direct_loaded: LatencyStats,
}

pub(super) const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
pub(super) const ECHO_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 3);
pub(super) const ECHO_VIP: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
pub(super) const POD_GATEWAY: &str = "169.254.1.1";

/// node ─ vp1 ─ client pod (10.0.0.2), node ─ vp2 ─ echo pod (10.0.0.3); nothing else.
pub(super) struct Lab {
    pub(super) node: Netns,
    pub(super) client: Netns,
    pub(super) echo: Netns,
}

impl Lab {
    pub(super) fn create(label: &str) -> Result<Lab> {
        let node = Netns::create(&format!("{label}-node"))?;
        node.sysctl(&[
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ])?;
        let client = Netns::create(&format!("{label}-client"))?;
        let echo = Netns::create(&format!("{label}-echo"))?;
        for (link, pod, ip) in [("vp1", &client, CLIENT_IP), ("vp2", &echo, ECHO_IP)] {
            node.ip_batch(&[
                &format!(
                    "link add {link} type veth peer name eth0 netns {}",
                    pod.name()
                ),
                &format!("link set {link} up"),
                &format!("addr add {POD_GATEWAY}/32 dev {link} scope link"),
                &format!("route add {ip}/32 dev {link}"),
            ])?;
            pod.ip_batch(&[
                "link set eth0 up",
                &format!("addr add {ip}/32 dev eth0"),
                &format!("route add {POD_GATEWAY} dev eth0 scope link"),
                &format!("route add default via {POD_GATEWAY} dev eth0"),
            ])?;
        }
        Ok(Lab { node, client, echo })
    }

    pub(super) fn sync(&self, cluster: &Cluster, config: &BuildConfig) -> Result<()> {
        self.node.run_in(|| {
            let mut config = config.clone();
            config.local_addresses = nftproxy::addresses::local_addresses();
            Syncer::new()?.sync(cluster, &config, true)?;
            Ok(())
        })
    }

    /// Connect times (µs) of `count` connections to `dst` after `warmup` unmeasured ones, and
    /// the number of measured connections that failed.
    pub(super) fn connect_times(
        &self,
        dst: SocketAddr,
        count: usize,
        warmup: usize,
    ) -> Result<Samples> {
        self.client.run_in(|| {
            let mut times = Vec::with_capacity(count);
            let mut failures = 0;
            for i in 0..warmup + count {
                let t = Instant::now();
                match TcpStream::connect_timeout(&dst, Duration::from_secs(1)) {
                    Ok(s) => {
                        let elapsed = t.elapsed();
                        // Close with RST: no TIME_WAIT, no lingering conntrack entries.
                        let linger = libc::linger {
                            l_onoff: 1,
                            l_linger: 0,
                        };
                        // SAFETY: setsockopt on an open socket with a correctly sized value.
                        unsafe {
                            libc::setsockopt(
                                s.as_raw_fd(),
                                libc::SOL_SOCKET,
                                libc::SO_LINGER,
                                (&linger as *const libc::linger).cast(),
                                size_of::<libc::linger>() as libc::socklen_t,
                            )
                        };
                        if i >= warmup {
                            times.push(elapsed.as_secs_f64() * 1e6);
                        }
                    }
                    Err(_) if i >= warmup => failures += 1,
                    Err(_) => {}
                }
            }
            Ok(Samples { times, failures })
        })
    }
}

/// Connect times of one kind of connection, gathered over several rounds.
#[derive(Default)]
pub(super) struct Samples {
    pub(super) times: Vec<f64>,
    pub(super) failures: usize,
}

impl Samples {
    pub(super) fn add(&mut self, more: Samples) {
        self.times.extend(more.times);
        self.failures += more.failures;
    }

    pub(super) fn stats(mut self, what: &str) -> Result<LatencyStats> {
        let count = self.times.len() + self.failures;
        ensure!(
            self.failures * 100 <= count,
            "{} of {count} connections {what} failed",
            self.failures
        );
        self.times.sort_by(f64::total_cmp);
        let times = &self.times;
        Ok(LatencyStats {
            connections: times.len(),
            failures: self.failures,
            p50_us: percentile(times, 0.50),
            p90_us: percentile(times, 0.90),
            p99_us: percentile(times, 0.99),
            mean_us: times.iter().sum::<f64>() / times.len().max(1) as f64,
        })
    }
}

/// An accept-and-close TCP server on `ECHO_IP:8080` in `ns`, until `stop`.
pub(super) fn echo_server(
    ns: &Netns,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let file = std::fs::File::open(Path::new("/run/netns").join(ns.name()))?;
    let handle = std::thread::spawn(move || {
        // SAFETY: setns(2) on an open namespace file; affects only this thread.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let _ = tx.send(Err(std::io::Error::last_os_error()));
            return;
        }
        let listener = match TcpListener::bind((ECHO_IP, synth::TARGET_PORT))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
        {
            Ok(l) => l,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        let _ = tx.send(Ok(()));
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((s, _)) => drop(s),
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    });
    rx.recv()
        .context("echo server thread died")?
        .context("echo server")?;
    Ok(handle)
}

/// Rounds the connections of each kind are spread over (see [`latency_bench`]).
pub(super) const LATENCY_ROUNDS: usize = 10;

/// First-packet latency with one Service, and with `cluster` loaded as well, in two labs side by
/// side. The connections alternate between the labs in rounds, so that both see the machine in
/// the same state: measured one after the other, the two figures moved apart by up to ±30% on
/// this VM whatever was loaded, as did the direct connections without any DNAT.
pub fn latency_bench(
    label: &str,
    cluster: &Cluster,
    config: &BuildConfig,
    count: usize,
) -> Result<LatencyResult> {
    let one_lab = Lab::create(&format!("{label}-1"))?;
    let loaded_lab = Lab::create(&format!("{label}-n"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let servers = [
        echo_server(&one_lab.echo, stop.clone())?,
        echo_server(&loaded_lab.echo, stop.clone())?,
    ];
    let result = (|| -> Result<LatencyResult> {
        let echo = synth::echo_objects(ECHO_VIP, ECHO_IP);
        let mut one = synth::to_cluster(&synth::base_objects())?;
        synth::add_to_cluster(&mut one, &echo)?;
        let mut loaded = cluster.clone();
        synth::add_to_cluster(&mut loaded, &echo)?;
        one_lab.sync(&one, config)?;
        loaded_lab.sync(&loaded, config)?;
        let vip = SocketAddr::from((ECHO_VIP, synth::PORT));
        let direct = SocketAddr::from((ECHO_IP, synth::TARGET_PORT));
        let warmup = (count / 10).max(50);
        let kinds = [
            (&one_lab, direct),
            (&one_lab, vip),
            (&loaded_lab, direct),
            (&loaded_lab, vip),
        ];
        for (lab, dst) in kinds {
            lab.connect_times(dst, 0, warmup)?;
        }
        let mut samples: [Samples; 4] = Default::default();
        let per_round = count.div_ceil(LATENCY_ROUNDS);
        for round in 0..LATENCY_ROUNDS {
            // Each round in another order, so that no kind always follows the same one.
            for i in 0..kinds.len() {
                let k = (i + round) % kinds.len();
                let (lab, dst) = kinds[k];
                samples[k].add(lab.connect_times(dst, per_round, 0)?);
            }
        }
        let [direct_one, one_service, direct_loaded, loaded] = samples;
        Ok(LatencyResult {
            one_service: one_service.stats("through the ClusterIP, one Service")?,
            loaded: loaded.stats("through the ClusterIP, all Services")?,
            direct_one_service: direct_one.stats("to the pod, one Service")?,
            direct_loaded: direct_loaded.stats("to the pod, all Services")?,
        })
    })();
    stop.store(true, Ordering::Relaxed);
    for server in servers {
        let _ = server.join();
    }
    result
}
