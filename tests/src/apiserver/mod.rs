//! An in-memory Kubernetes API server for end-to-end tests, speaking real list/watch (with
//! resourceVersions, `limit`/`continue` pages, selectors, bookmarks and `410 Gone`) over
//! plain HTTP to the real kube-rs client, with switches for faults.
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

mod http;
pub mod selector;
pub mod store;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;

use crate::lab::Ns;
use store::{ApiError, Store, kind_named};

/// One request the server received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLog {
    pub method: String,
    /// Path and query as sent, e.g. `/api/v1/services?&limit=500`.
    pub uri: String,
    pub at: Instant,
    /// The response status, once answered (a stalled request has none).
    pub status: Option<u16>,
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
    requests: Mutex<Vec<RequestLog>>,
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
        });
        log.len() - 1
    }

    fn log_status(&self, entry: usize, status: u16) {
        if let Some(e) = lock(&self.requests).get_mut(entry) {
            e.status = Some(status);
        }
    }

    fn set_listening(&self, on: bool) {
        *lock(&self.listening.0) = on;
        self.listening.1.notify_all();
    }
}

/// The server; stopped (with its thread) on drop.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Starts a server inside the lab namespace `ns`, on `127.0.0.1:<free port>` there.
    pub fn start_in(ns: &Ns) -> Result<ApiServer> {
        ApiServer::spawn(Some(ns.name().to_string()))
    }

    /// Starts a server inside the network namespace `/run/netns/<name>`.
    pub fn start_in_netns(name: &str) -> Result<ApiServer> {
        ApiServer::spawn(Some(name.to_string()))
    }

    /// Starts a server in the calling thread's network namespace.
    pub fn start() -> Result<ApiServer> {
        ApiServer::spawn(None)
    }

    fn spawn(netns: Option<String>) -> Result<ApiServer> {
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
            requests: Mutex::default(),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_shared = shared.clone();
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
                    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
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
        let dir = tempfile::Builder::new()
            .prefix("nftpt-apiserver-")
            .tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_yaml(&format!("http://{addr}")))?;
        Ok(ApiServer {
            shared,
            addr,
            kubeconfig,
            _dir: dir,
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:<port>` (reachable inside the server's namespace).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kubeconfig file for [`ApiServer::url`] (dummy token, `default` namespace), removed
    /// on drop.
    pub fn kubeconfig(&self) -> PathBuf {
        self.kubeconfig.clone()
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

/// Registers a connection in [`Shared::conns`] while it lives.
struct ConnGuard(Arc<Shared>, u64);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        lock(&self.0.conns.0).remove(&self.1);
        self.0.conns.1.notify_all();
    }
}

fn spawn_connection(shared: &Arc<Shared>, stream: tokio::net::TcpStream) {
    let mut kill = shared.kill.subscribe();
    let id = shared.conn_ids.fetch_add(1, Ordering::Relaxed);
    lock(&shared.conns.0).insert(id, *kill.borrow());
    let guard = ConnGuard(shared.clone(), id);
    let svc_shared = shared.clone();
    let svc = hyper::service::service_fn(move |req| http::handle(svc_shared.clone(), req));
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
    tokio::spawn(async move {
        tokio::select! {
            biased;
            _ = kill.changed() => {}
            _ = conn => {}
        }
        drop(guard);
    });
}

fn bind(addr: SocketAddr) -> Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket
        .bind(addr)
        .with_context(|| format!("binding {addr}"))?;
    Ok(socket.listen(128)?)
}

/// Moves the calling thread into the network namespace `/run/netns/<name>`.
pub fn enter_netns(name: &str) -> Result<()> {
    let path = Path::new("/run/netns").join(name);
    let file = std::fs::File::open(&path).with_context(|| path.display().to_string())?;
    // SAFETY: setns on a valid namespace fd only changes this thread's network namespace.
    let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
    if rc != 0 {
        bail!(
            "setns {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Runs `f` on a new thread inside the network namespace `/run/netns/<name>` and returns
/// its result (e.g. a kube client talking to an [`ApiServer`] there).
pub fn in_netns<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_netns(name)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
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
    token: nftproxy-test-token
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
