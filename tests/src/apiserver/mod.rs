//! An in-memory Kubernetes API server for end-to-end tests, speaking real list/watch (with
//! resourceVersions, `limit`/`continue` pages, selectors, bookmarks and `410 Gone`) to the
//! real kube-rs client, with switches for faults.
//!
//! It serves v1 Services and Nodes, discovery.k8s.io/v1 EndpointSlices and
//! networking.k8s.io/v1 ServiceCIDRs, stored as JSON. [`ApiServer::start_in`] runs it on a
//! thread inside a lab namespace, on `127.0.0.1:<port>` there, so an agent started in that
//! namespace reaches it while the test drives it in-process:
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use nftproxy_tests::{ApiServer, Lab};
//! let lab = Lab::new()?;
//! let node = lab.node("node")?;
//! let api = ApiServer::start_in(&node)?;
//! api.apply(serde_json::json!({
//!     "apiVersion": "v1", "kind": "Service",
//!     "metadata": {"name": "web", "namespace": "default"},
//!     "spec": {"clusterIP": "172.30.0.10", "ports": [{"port": 80}]},
//! }))?;
//! let kubeconfig = api.kubeconfig(); // give it to the agent
//! api.compact(); // watches from older resourceVersions now get 410 Gone
//! api.drop_connections();
//! # Ok(()) }
//! ```
//!
//! [`ApiServer::builder`] makes it look like a real cluster's instead:
//! - `.tls(true)`: HTTPS (HTTP/1.1) with a CA and a serving certificate made at start, and
//!   a required bearer token (requests without it get a 401 `Status`). Its temp dir holds
//!   a ServiceAccount dir ([`ApiServer::service_account_dir`]: `token`, `ca.crt`,
//!   `namespace`) and a kubeadm-style kubeconfig reading those files;
//!   [`ApiServer::write_kubeconfig`] writes one for other paths, e.g. under
//!   [`SERVICE_ACCOUNT_DIR`] where a test mounts them.
//! - `.netns(name)`, `.bind(ip)`, `.port(6443)`: listen on a chosen IPv4 or IPv6 address
//!   and port in a (control-plane) namespace, reached over a veth or a ClusterIP DNAT
//!   (`.san(ip)` adds that ClusterIP to the certificate).
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use nftproxy_tests::{ApiServer, Lab, ip};
//! let lab = Lab::new()?;
//! let node = lab.node("node")?;
//! let cp = lab.external(&node, "cp", &[ip("192.0.2.1")], &[ip("192.0.2.254")])?;
//! let api = ApiServer::builder()
//!     .netns(cp.name())
//!     .bind(ip("192.0.2.1"))
//!     .port(6443)
//!     .tls(true)
//!     .san(ip("10.96.0.1"))
//!     .start()?;
//! assert_eq!(api.url(), "https://192.0.2.1:6443");
//! api.set_list_delay(std::time::Duration::from_secs(2)); // slow LISTs
//! api.set_fail("nodes", Some(500)); // every nodes request fails
//! # Ok(()) }
//! ```

mod http;
mod net;
pub mod selector;
pub mod store;
mod tls;

pub use self::net::*;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::lab::Ns;
use store::{ApiError, Store, kind_named};
pub use tls::kubeadm_kubeconfig;

/// Where a pod sees its ServiceAccount's `token`, `ca.crt` and `namespace`.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The namespace written to the ServiceAccount dir's `namespace` file (kube-proxy's).
pub const SERVICE_ACCOUNT_NAMESPACE: &str = "kube-system";
/// The token of a server that does not make its own ([`ApiServerBuilder::tls`] off).
const PLAIN_TOKEN: &str = "nftproxy-test-token";

/// One request the server received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLog {
    pub method: String,
    /// Path and query as sent, e.g. `/api/v1/services?&limit=500`.
    pub uri: String,
    pub at: Instant,
    /// The response status, once answered (a stalled request has none).
    pub status: Option<u16>,
    /// When the response (for a watch: its head) was sent.
    pub answered: Option<Instant>,
}

impl RequestLog {
    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or("")
    }

    /// Whether this was a watch (`watch=true` or `watch=1`).
    pub fn is_watch(&self) -> bool {
        self.uri
            .split(['?', '&'])
            .any(|p| p == "watch=true" || p == "watch=1")
    }
}

/// State shared by the server thread and the test's handle.
pub(crate) struct Shared {
    store: Mutex<Store>,
    /// The store's resourceVersion after each write; wakes watches.
    changed: watch::Sender<u64>,
    stall: watch::Sender<bool>,
    /// Bumped to close every connection.
    kill: watch::Sender<u64>,
    /// Open connections: id → the `kill` epoch they were accepted in.
    conns: (Mutex<HashMap<u64, u64>>, Condvar),
    conn_ids: AtomicU64,
    refuse: watch::Sender<bool>,
    shutdown: watch::Sender<bool>,
    /// Whether the listener is open, as last set by the server loop.
    listening: (Mutex<bool>, Condvar),
    serve_servicecidrs: AtomicBool,
    bookmark_ms: AtomicU64,
    active_watches: AtomicUsize,
    /// Every watch stream gets the next number.
    watch_ids: AtomicU64,
    /// Watch streams numbered below this send nothing ([`ApiServer::set_mute_watches`]).
    mute_below: watch::Sender<u64>,
    /// `Retry-After` seconds on injected 429 and 5xx answers (0: none).
    retry_after_secs: AtomicU64,
    requests: Mutex<Vec<RequestLog>>,
    /// TLS on every connection, when on.
    tls: Option<TlsAcceptor>,
    /// Requests without `Authorization: Bearer <this>` get 401, when set.
    required_token: Option<String>,
    list_delay_ms: AtomicU64,
    /// Injected failures: resource plural → HTTP status.
    fail: Mutex<HashMap<&'static str, u16>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    fn write(&self, obj: Value, create_only: bool, replace_only: bool) -> Result<Value, ApiError> {
        let mut store = self.store();
        let obj = store.write(obj, create_only, replace_only)?;
        self.changed.send_replace(store.rv());
        Ok(obj)
    }

    fn delete(&self, kind: &'static store::Kind, ns: &str, name: &str) -> Result<Value, ApiError> {
        let mut store = self.store();
        let obj = store.delete(kind, ns, name)?;
        self.changed.send_replace(store.rv());
        Ok(obj)
    }

    fn bookmark_interval(&self) -> Duration {
        Duration::from_millis(self.bookmark_ms.load(Ordering::Relaxed))
    }

    fn log_request(&self, method: &str, uri: &str) -> usize {
        let mut log = lock(&self.requests);
        log.push(RequestLog {
            method: method.to_string(),
            uri: uri.to_string(),
            at: Instant::now(),
            status: None,
            answered: None,
        });
        log.len() - 1
    }

    fn log_status(&self, entry: usize, status: u16) {
        if let Some(e) = lock(&self.requests).get_mut(entry) {
            e.status = Some(status);
            e.answered = Some(Instant::now());
        }
    }

    fn list_delay(&self) -> Duration {
        Duration::from_millis(self.list_delay_ms.load(Ordering::Relaxed))
    }

    /// The injected status for requests on `plural`, if any.
    fn failure(&self, plural: &str) -> Option<u16> {
        lock(&self.fail).get(plural).copied()
    }

    fn set_listening(&self, on: bool) {
        *lock(&self.listening.0) = on;
        self.listening.1.notify_all();
    }
}

/// How to start an [`ApiServer`], from [`ApiServer::builder`]. The defaults are those of
/// [`ApiServer::start`]: plain HTTP on `127.0.0.1:<free port>` in the calling thread's
/// namespace, no token required.
#[derive(Debug, Clone)]
pub struct ApiServerBuilder {
    netns: Option<String>,
    ip: IpAddr,
    port: u16,
    tls: bool,
    require_token: Option<bool>,
    extra_sans: Vec<IpAddr>,
}

impl ApiServerBuilder {
    /// Runs the server inside the network namespace `/run/netns/<name>` (e.g. `ns.name()`).
    pub fn netns(mut self, name: &str) -> Self {
        self.netns = Some(name.to_string());
        self
    }

    /// Listens on this address (IPv4 or IPv6; it must exist in the namespace), not
    /// 127.0.0.1.
    pub fn bind(mut self, ip: IpAddr) -> Self {
        self.ip = ip;
        self
    }

    /// Listens on this port (e.g. 6443), not a free one.
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// HTTPS with a CA made at start, and (unless [`ApiServerBuilder::require_token`] says
    /// otherwise) a required bearer token, like a real cluster.
    pub fn tls(mut self, on: bool) -> Self {
        self.tls = on;
        self
    }

    /// Whether requests need `Authorization: Bearer <token>` (default: with TLS).
    pub fn require_token(mut self, on: bool) -> Self {
        self.require_token = Some(on);
        self
    }

    /// One more IP address for the certificate (e.g. the `kubernetes` Service's ClusterIP,
    /// 10.96.0.1). It always covers the bind address, 127.0.0.1, ::1, `localhost` and the
    /// `kubernetes.default.svc` names.
    pub fn san(mut self, ip: IpAddr) -> Self {
        self.extra_sans.push(ip);
        self
    }

    pub fn start(self) -> Result<ApiServer> {
        ApiServer::spawn(self)
    }
}

/// The server; stopped (with its thread) on drop.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    ca_pem: Option<String>,
    token: String,
    kubeconfig: PathBuf,
    sa_dir: PathBuf,
    _dir: tempfile::TempDir,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts a server inside the lab namespace `ns`, on `127.0.0.1:<free port>` there.
    pub fn start_in(ns: &Ns) -> Result<ApiServer> {
        ApiServer::builder().netns(ns.name()).start()
    }

    /// Starts a server inside the network namespace `/run/netns/<name>`.
    pub fn start_in_netns(name: &str) -> Result<ApiServer> {
        ApiServer::builder().netns(name).start()
    }

    /// Starts a server in the calling thread's network namespace.
    pub fn start() -> Result<ApiServer> {
        ApiServer::builder().start()
    }

    /// Options: namespace, address, port, TLS and token.
    pub fn builder() -> ApiServerBuilder {
        ApiServerBuilder {
            netns: None,
            ip: Ipv4Addr::LOCALHOST.into(),
            port: 0,
            tls: false,
            require_token: None,
            extra_sans: Vec::new(),
        }
    }

    fn spawn(opts: ApiServerBuilder) -> Result<ApiServer> {
        let pki = if opts.tls {
            let mut ips = vec![opts.ip];
            ips.extend(&opts.extra_sans);
            Some(tls::Pki::new(&ips)?)
        } else {
            None
        };
        let token = if opts.tls {
            tls::random_token()?
        } else {
            PLAIN_TOKEN.to_string()
        };
        let required = opts.require_token.unwrap_or(opts.tls);
        let dir = tempfile::Builder::new()
            .prefix("nftpt-apiserver-")
            .tempdir()?;
        let shared = Arc::new(Shared {
            store: Mutex::default(),
            changed: watch::Sender::new(0),
            stall: watch::Sender::new(false),
            kill: watch::Sender::new(0),
            conns: (Mutex::default(), Condvar::new()),
            conn_ids: AtomicU64::new(0),
            refuse: watch::Sender::new(false),
            shutdown: watch::Sender::new(false),
            listening: (Mutex::new(false), Condvar::new()),
            serve_servicecidrs: AtomicBool::new(true),
            bookmark_ms: AtomicU64::new(1000),
            active_watches: AtomicUsize::new(0),
            watch_ids: AtomicU64::new(0),
            mute_below: watch::Sender::new(0),
            retry_after_secs: AtomicU64::new(0),
            requests: Mutex::default(),
            tls: pki.as_ref().map(|p| p.acceptor.clone()),
            required_token: required.then(|| token.clone()),
            list_delay_ms: AtomicU64::new(0),
            fail: Mutex::default(),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_shared = shared.clone();
        let addr = SocketAddr::new(opts.ip, opts.port);
        let netns = opts.netns;
        let thread = std::thread::Builder::new()
            .name("apiserver".into())
            .spawn(move || {
                let rt = match netns.as_deref().map_or(Ok(()), enter_netns).and_then(|()| {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build();
                    rt.context("tokio runtime")
                }) {
                    Ok(rt) => rt,
                    Err(e) => return drop(ready_tx.send(Err(e))),
                };
                rt.block_on(async move {
                    let listener = match bind(addr) {
                        Ok(l) => l,
                        Err(e) => return drop(ready_tx.send(Err(e))),
                    };
                    let addr = listener.local_addr().expect("bound socket has an address");
                    let _ = ready_tx.send(Ok(addr));
                    serve(thread_shared, listener, addr).await;
                });
            })?;
        let addr = ready_rx
            .recv()
            .map_err(|_| anyhow!("apiserver thread died"))??;
        let server = ApiServer {
            shared,
            addr,
            ca_pem: pki.map(|p| p.ca_pem),
            token,
            kubeconfig: dir.path().join("kubeconfig"),
            sa_dir: dir.path().join("serviceaccount"),
            _dir: dir,
            thread: Some(thread),
        };
        server.write_files()?;
        Ok(server)
    }

    /// Writes the ServiceAccount files and the kubeconfig.
    fn write_files(&self) -> Result<()> {
        let sa = &self.sa_dir;
        std::fs::create_dir(sa)?;
        std::fs::write(sa.join("token"), &self.token)?;
        std::fs::write(sa.join("namespace"), SERVICE_ACCOUNT_NAMESPACE)?;
        match &self.ca_pem {
            Some(ca) => {
                std::fs::write(sa.join("ca.crt"), ca)?;
                let (ca_file, token_file) = (sa.join("ca.crt"), sa.join("token"));
                self.write_kubeconfig(&self.kubeconfig, &ca_file, &token_file)
            }
            None => Ok(std::fs::write(
                &self.kubeconfig,
                kubeconfig_yaml(&self.url()),
            )?),
        }
    }

    /// `http://<addr>`, or `https://<addr>` with TLS (reachable inside the server's
    /// namespace, or over a route to its bind address).
    pub fn url(&self) -> String {
        let scheme = if self.ca_pem.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kubeconfig file for [`ApiServer::url`], removed on drop. Plain HTTP: an inline
    /// dummy token, `default` namespace. TLS: kubeadm-style, trusting only the server's CA
    /// and reading the token from [`ApiServer::service_account_dir`].
    pub fn kubeconfig(&self) -> PathBuf {
        self.kubeconfig.clone()
    }

    /// Writes a kubeadm-style kubeconfig for [`ApiServer::url`] to `dest` that reads the CA
    /// and the token from these paths (which need not exist here: e.g. under
    /// [`SERVICE_ACCOUNT_DIR`] where the files are mounted). See [`kubeadm_kubeconfig`] for
    /// another server address (e.g. a ClusterIP).
    pub fn write_kubeconfig(&self, dest: &Path, ca_file: &Path, token_file: &Path) -> Result<()> {
        let text = kubeadm_kubeconfig(&self.url(), ca_file, token_file);
        std::fs::write(dest, text).with_context(|| dest.display().to_string())
    }

    /// The cluster CA certificate (PEM), with TLS.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// The bearer token (required if [`ApiServerBuilder::require_token`], by default with
    /// TLS).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// A directory like a pod's [`SERVICE_ACCOUNT_DIR`]: `token`, `namespace`
    /// ([`SERVICE_ACCOUNT_NAMESPACE`]) and, with TLS, `ca.crt`. Removed on drop.
    pub fn service_account_dir(&self) -> &Path {
        &self.sa_dir
    }

    /// Creates or replaces an object (its `kind`, `metadata.namespace`, `metadata.name`);
    /// a `kind: List` applies its items. Returns the stored object.
    pub fn apply(&self, obj: Value) -> Result<Value> {
        if obj["kind"] == "List" {
            let items = obj["items"].as_array().cloned().unwrap_or_default();
            let stored = items
                .into_iter()
                .map(|o| self.apply(o))
                .collect::<Result<_>>()?;
            return Ok(Value::Array(stored));
        }
        Ok(self.shared.write(obj, false, false)?)
    }

    /// Applies every object of a (multi-document) YAML text; `kind: List` documents too.
    pub fn apply_yaml(&self, yaml: &str) -> Result<()> {
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let obj: Value = serde::Deserialize::deserialize(doc).context("parsing YAML")?;
            if !obj.is_null() {
                self.apply(obj)?;
            }
        }
        Ok(())
    }

    /// Applies a YAML file.
    pub fn apply_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        self.apply_yaml(&text)
    }

    /// Deletes an object (`kind` like `Service` or `services`; `namespace` ignored for
    /// cluster-scoped kinds).
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) -> Result<Value> {
        let kind = kind_named(kind).ok_or_else(|| anyhow!("unknown kind {kind:?}"))?;
        Ok(self.shared.delete(kind, namespace, name)?)
    }

    pub fn get(&self, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let kind = kind_named(kind)?;
        self.shared.store().get(kind, namespace, name).cloned()
    }

    /// Every object of a kind, sorted by namespace and name.
    pub fn list(&self, kind: &str) -> Vec<Value> {
        let Some(kind) = kind_named(kind) else {
            return Vec::new();
        };
        let snapshot = self.shared.store().snapshot(kind, None).unwrap_or_default();
        snapshot.into_iter().map(|(_, o)| o).collect()
    }

    /// The resourceVersion of the latest write.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv()
    }

    /// Closes every open connection (and so every watch); returns once they are closed.
    pub fn drop_connections(&self) {
        let mut epoch = 0;
        self.shared.kill.send_modify(|n| {
            *n += 1;
            epoch = *n;
        });
        let (m, cv) = &self.shared.conns;
        let (conns, timeout) = cv
            .wait_timeout_while(lock(m), Duration::from_secs(10), |c| {
                c.values().any(|e| *e < epoch)
            })
            .unwrap_or_else(|e| e.into_inner());
        assert!(
            !timeout.timed_out(),
            "apiserver connections still open: {conns:?}"
        );
    }

    /// While on, requests (new and on open connections) get no answer and open watches
    /// send nothing; when turned off they go on.
    pub fn set_stall(&self, on: bool) {
        self.shared.stall.send_replace(on);
    }

    /// While on, the watch streams open when it was turned on send nothing (no events, no
    /// bookmarks), like connections that died without a word; requests, and watches started
    /// later, are served as usual. When turned off, the muted streams go on.
    pub fn set_mute_watches(&self, on: bool) {
        let below = if on {
            self.shared.watch_ids.load(Ordering::SeqCst)
        } else {
            0
        };
        self.shared.mute_below.send_replace(below);
    }

    /// Injected 429 and 5xx answers ([`ApiServer::set_fail`]) carry `Retry-After` (whole
    /// seconds) and `details.retryAfterSeconds`, as the apiserver's 429s do; `None` (the
    /// default) leaves them out.
    pub fn set_retry_after(&self, after: Option<Duration>) {
        let secs = after.map_or(0, |d| d.as_secs().max(1));
        self.shared.retry_after_secs.store(secs, Ordering::Relaxed);
    }

    /// While on, the port is closed (connection refused) and open connections are dropped.
    /// Returns once the listener is closed / open again.
    pub fn set_refuse(&self, on: bool) {
        self.shared.refuse.send_replace(on);
        self.wait_listening(!on);
        if on {
            self.drop_connections();
        }
    }

    /// Forgets the watch history up to now: watches from an older resourceVersion get an
    /// in-stream 410 ERROR event, and so do exact LISTs and `continue` tokens from before.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// Like an apiserver restart: closes the port and every connection, compacts the
    /// history (objects and the resourceVersion counter are kept), listens again on the
    /// same port.
    pub fn restart(&self) {
        let refused = *self.shared.refuse.borrow();
        self.set_refuse(true);
        self.compact();
        if !refused {
            self.set_refuse(false);
        }
    }

    /// With `false`, `networking.k8s.io/v1` `servicecidrs` answers 404 (and is left out of
    /// discovery), like a cluster that does not serve that API.
    pub fn set_serve_servicecidrs(&self, on: bool) {
        self.shared.serve_servicecidrs.store(on, Ordering::Relaxed);
    }

    /// How often watches with `allowWatchBookmarks=true` get a BOOKMARK (default 1 s).
    pub fn set_bookmark_interval(&self, every: Duration) {
        let ms = every.as_millis().clamp(1, u64::MAX.into()) as u64;
        self.shared.bookmark_ms.store(ms, Ordering::Relaxed);
    }

    /// Every LIST (a GET on a collection without `watch`) is answered only after this
    /// delay, with the state at that time; zero (the default) turns it off.
    pub fn set_list_delay(&self, delay: Duration) {
        let ms = delay.as_millis().min(u64::MAX.into()) as u64;
        self.shared.list_delay_ms.store(ms, Ordering::Relaxed);
    }

    /// Every request for `resource` (a plural like `nodes` or a kind like `Node`; lists,
    /// watches, gets and writes) gets this HTTP status (400..=599) with a `Status` body,
    /// e.g. 500 `InternalError` or 403 `Forbidden`, until cleared with `None`.
    /// Panics on an unknown resource or status.
    pub fn set_fail(&self, resource: &str, status: Option<u16>) {
        let kind = kind_named(resource).unwrap_or_else(|| panic!("unknown resource {resource:?}"));
        let mut fail = lock(&self.shared.fail);
        match status {
            Some(code) => {
                assert!((400..600).contains(&code), "not an error status: {code}");
                fail.insert(kind.plural, code);
            }
            None => {
                fail.remove(kind.plural);
            }
        }
    }

    /// The requests received so far, oldest first.
    pub fn requests(&self) -> Vec<RequestLog> {
        lock(&self.shared.requests).clone()
    }

    /// How many watch streams are open.
    pub fn active_watches(&self) -> usize {
        self.shared.active_watches.load(Ordering::Relaxed)
    }

    fn wait_listening(&self, want: bool) {
        let (m, cv) = &self.shared.listening;
        let (on, timeout) = cv
            .wait_timeout_while(lock(m), Duration::from_secs(10), |on| *on != want)
            .unwrap_or_else(|e| e.into_inner());
        assert!(
            !timeout.timed_out(),
            "apiserver listener did not turn {} (is {})",
            if want { "on" } else { "off" },
            *on
        );
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The test failed: show what the client asked.
            let log = self.requests();
            let start = log.first().map(|r| r.at);
            eprintln!("apiserver {} request log:", self.url());
            for r in &log {
                let t = r.at - start.unwrap_or(r.at);
                let status = r.status.map_or("-".into(), |s| s.to_string());
                eprintln!(
                    "  {:>8.3}s {status} {} {}",
                    t.as_secs_f64(),
                    r.method,
                    r.uri
                );
            }
        }
        self.shared.shutdown.send_replace(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The accept loop: listens unless refusing, serves each connection until it ends or
/// [`ApiServer::drop_connections`].
async fn serve(shared: Arc<Shared>, listener: TcpListener, addr: SocketAddr) {
    let mut listener = Some(listener);
    let mut refuse = shared.refuse.subscribe();
    let mut shutdown = shared.shutdown.subscribe();
    loop {
        if *refuse.borrow_and_update() {
            listener = None;
        } else if listener.is_none() {
            match bind(addr) {
                Ok(l) => listener = Some(l),
                Err(e) => {
                    eprintln!("apiserver: re-binding {addr}: {e:#}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
        }
        shared.set_listening(listener.is_some());
        let accept = async {
            match &listener {
                Some(l) => l.accept().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = refuse.changed() => {}
            conn = accept => match conn {
                Ok((stream, _)) => spawn_connection(&shared, stream),
                Err(e) => eprintln!("apiserver: accept: {e}"),
            },
        }
    }
}

fn kubeconfig_yaml(server: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: nftproxy-test
  cluster:
    server: {server}
    insecure-skip-tls-verify: true
users:
- name: nftproxy-test
  user:
    token: {PLAIN_TOKEN}
contexts:
- name: nftproxy-test
  context:
    cluster: nftproxy-test
    user: nftproxy-test
    namespace: default
current-context: nftproxy-test
"
    )
}
