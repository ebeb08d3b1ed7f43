//! Helpers: running code inside a namespace, a minimal HTTP client, the agent, Prometheus.

use super::*;

// ---------------------------------------------------------------------------------------------
// Helpers: running code inside a namespace, a minimal HTTP client, the agent, Prometheus.

/// Runs `f` on a thread that has joined the network namespace `ns` (sockets it opens belong to
/// that namespace and keep working from any thread).
pub(super) fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    nftproxy_tests::apiserver::in_netns(ns, f).expect("enter the namespace")
}

/// Raises this process's soft open-files limit to the hard limit (for 1,000 connections).
pub(super) fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[derive(Debug)]
pub(super) struct HttpResponse {
    pub(super) status: u16,
    /// Header lines as sent (name, value), in order.
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: String,
}

impl HttpResponse {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub(super) fn parse_response(raw: &[u8]) -> Result<HttpResponse, String> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no header end in {text:?}"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    let chunked = headers.iter().any(|(n, v)| {
        n.eq_ignore_ascii_case("Transfer-Encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

/// Decodes a `Transfer-Encoding: chunked` body (Prometheus' API answers use it).
pub(super) fn dechunk(mut rest: &str) -> Result<String, String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest
            .split_once("\r\n")
            .ok_or_else(|| format!("bad chunk in {rest:?}"))?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|e| format!("chunk size {size:?}: {e}"))?;
        if size == 0 {
            return Ok(out);
        }
        let chunk = after
            .get(..size)
            .ok_or_else(|| format!("short chunk in {after:?}"))?;
        out.push_str(chunk);
        rest = after
            .get(size..)
            .and_then(|r| r.strip_prefix("\r\n"))
            .ok_or_else(|| format!("no chunk end in {after:?}"))?;
    }
}

/// One `GET` (from the calling thread's namespace), `Connection: close`.
pub(super) fn get_here(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<HttpResponse, String> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: observability-test\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    parse_response(&raw)
}

/// One `GET` from inside namespace `ns`.
pub(super) fn get(ns: &Ns, addr: SocketAddr, path: &str) -> Result<HttpResponse, String> {
    let path = path.to_string();
    in_netns(ns.name(), move || {
        get_here(addr, &path, Duration::from_secs(5))
    })
}

/// Polls `f` every 100 ms until it returns `Some`, or panics after `timeout` with `what` and
/// the last observation.
pub(super) fn wait_for<T, D: std::fmt::Debug>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<T, D>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) => {
                if Instant::now() > deadline {
                    panic!("timed out after {timeout:?} waiting for {what}; last: {last:?}");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `nftproxy run --from-file` agent in a node namespace, following a YAML file.
pub(super) struct Agent {
    pub(super) proc: Proc,
    pub(super) dir: tempfile::TempDir,
}

pub(super) const CONFIG: &str = "\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
hostnameOverride: test-node
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 0.0.0.0:10256
nftables: {syncPeriod: 1s, minSyncPeriod: 100ms}
";

pub(super) const METRICS: &str = "127.0.0.1:10249";
pub(super) const HEALTHZ: &str = "127.0.0.1:10256";

impl Agent {
    pub(super) fn start(node: &Ns, cluster_yaml: &str) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("config.yaml"), CONFIG).unwrap();
        let agent = |p: &str| dir.path().join(p);
        std::fs::write(agent("cluster.yaml"), cluster_yaml).unwrap();
        let bin = target_binary("nftproxy")
            .expect("build nftproxy first (cargo build --workspace --bins)");
        let mut cmd = node.command(bin);
        cmd.args(["run", "--from-file"])
            .arg(agent("cluster.yaml"))
            .arg("--config")
            .arg(agent("config.yaml"))
            .env("RUST_LOG", "info");
        let proc = node.spawn_command(cmd, "nftproxy").expect("start nftproxy");
        let agent = Agent { proc, dir };
        agent.wait_log("nftables sync committed");
        agent
    }

    pub(super) fn yaml_path(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    /// Replaces the followed file atomically (the agent never reads half a file).
    pub(super) fn rewrite(&self, cluster_yaml: &str) {
        let tmp = self.dir.path().join("cluster.yaml.new");
        std::fs::write(&tmp, cluster_yaml).unwrap();
        std::fs::rename(&tmp, self.yaml_path()).unwrap();
    }

    pub(super) fn wait_log(&self, needle: &str) {
        let needle = needle.to_string();
        self.proc
            .wait_stderr(|l| l.contains(&needle), Duration::from_secs(15))
            .unwrap_or_else(|e| panic!("{e:#}\nstderr: {:#?}", self.proc.stderr()));
    }

    pub(super) fn log_count(&self, needle: &str) -> usize {
        self.proc
            .stderr()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }
}

/// A process with a pipe to its stdin, killed (by PID) and reaped on drop.
pub(super) struct Piped {
    pub(super) child: Child,
}

impl Piped {
    pub(super) fn spawn(mut cmd: Command) -> Piped {
        let child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        Piped { child }
    }

    pub(super) fn send(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().expect("piped stdin");
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }
}

impl Drop for Piped {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(super) fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One series of a query result: its labels and value.
pub(super) type Sample = (BTreeMap<String, String>, f64);

/// A Prometheus server in the node's namespace on 127.0.0.1:9090, scraping the agent every
/// second; killed by PID on drop (as a [`Proc`]).
pub(super) struct Prometheus {
    pub(super) proc: Proc,
    pub(super) _dir: tempfile::TempDir,
    pub(super) ns: Ns,
}

pub(super) const PROMETHEUS: &str = "127.0.0.1:9090";

impl Prometheus {
    pub(super) fn start(node: &Ns) -> Prometheus {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: nftproxy\n    static_configs:\n      - targets: ['{METRICS}']\n"
        );
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        let mut cmd = node.command("/usr/bin/prometheus");
        cmd.arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={PROMETHEUS}"))
        .arg("--log.level=warn");
        let proc = node
            .spawn_command(cmd, "prometheus")
            .expect("start prometheus (Debian package prometheus)");
        let p = Prometheus {
            proc,
            _dir: dir,
            ns: node.clone(),
        };
        wait_for(
            "Prometheus to be ready",
            Duration::from_secs(20),
            || match get(&p.ns, PROMETHEUS.parse().unwrap(), "/-/ready") {
                Ok(r) if r.status == 200 => Ok(()),
                other => Err(format!("{other:?}")),
            },
        );
        p
    }

    /// An instant query: each series' labels and value.
    pub(super) fn query(&self, expr: &str) -> Result<Vec<Sample>, String> {
        let path = format!("/api/v1/query?query={}", percent_encode(expr));
        let r = get(&self.ns, PROMETHEUS.parse().unwrap(), &path)?;
        let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("{e}: {}", r.body))?;
        if v["status"] != "success" {
            return Err(r.body);
        }
        let series = v["data"]["result"].as_array().cloned().unwrap_or_default();
        Ok(series
            .iter()
            .map(|s| {
                let labels = s["metric"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                            .collect()
                    })
                    .unwrap_or_default();
                let value = s["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(f64::NAN);
                (labels, value)
            })
            .collect())
    }

    /// Waits until `expr` yields exactly one series with `value`.
    pub(super) fn wait_value(&self, expr: &str, value: f64) {
        wait_for(
            &format!("{expr} == {value} in Prometheus"),
            Duration::from_secs(20),
            || match self.query(expr) {
                Ok(s) if s.len() == 1 && s[0].1 == value => Ok(()),
                other => Err(format!("{other:?}")),
            },
        );
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // SIGTERM by PID first so it shuts its TSDB down cleanly, SIGKILL if it lingers.
        let _ = self.proc.terminate(Duration::from_secs(3));
    }
}
