//! How the agent reaches the API server, and what to tell the operator when it cannot.
//!
//! kube-proxy's rules: `--kubeconfig` wins over `clientConnection.kubeconfig`; `--master`
//! replaces the server either names; with neither, the in-cluster service account is used.
//! nftproxy adds two things. `--master` alone uses the in-cluster credentials (token and CA)
//! with that server, which is what a node proxy needs: the in-cluster address is the
//! `default/kubernetes` Service's ClusterIP, and only a running Service proxy makes that
//! reachable; on this node, that proxy is nftproxy itself. And when the server the client
//! uses is such a ClusterIP and nothing answers, the problem and its fix are named in the log
//! and in `/healthz`.
//!
//! The client stack ([`client_builder`]) bounds every request in time, as client-go's does
//! (see `docs/architecture.md`, "Startup"): TCP keepalive on every connection, an answer must
//! start within [`RESPONSE_TIMEOUT`], a list's body must keep coming ([`BODY_TIMEOUT`]), and a
//! watch that sends neither an event nor a bookmark for longer than its server's bookmark
//! cadence allows ([`Liveness::watch_bound`]) is ended so that kube-runtime's watcher resumes it
//! from its last resourceVersion. Lists start from the API server's watch cache
//! (`resourceVersion=0`, pages of 500), as client-go's informers do. [`Liveness`] hands what
//! the stack sees (answers, `Retry-After`) to the watchers.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use dataplane::model::Cluster;
use hyper::Request as HttpRequest;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::{ClientBuilder, ConfigExt};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceBuilder};

/// The kubelet's ServiceAccount mount.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A TCP connection to the API server that takes longer than this has failed: the operator
/// hears about an unreachable server within seconds rather than after the client's default
/// 30 s.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the client's configuration came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A kubeconfig file (`--kubeconfig` or `clientConnection.kubeconfig`).
    Kubeconfig(PathBuf),
    /// The in-cluster service account with the server from `KUBERNETES_SERVICE_HOST`.
    InCluster,
    /// `--master` with the in-cluster service account's credentials.
    Master,
    /// `$KUBECONFIG` or `~/.kube/config` (outside a cluster: a developer's machine).
    Local,
}

/// The client configuration and how it was chosen.
pub struct Target {
    pub config: kube::Config,
    pub origin: Origin,
}

impl Target {
    /// The server as the client reaches it, e.g. `https://10.96.0.1:443`.
    pub fn server(&self) -> String {
        self.config
            .cluster_url
            .to_string()
            .trim_end_matches('/')
            .to_string()
    }

    /// The server's address when it is an IP literal.
    pub fn server_ip(&self) -> Option<IpAddr> {
        let host = self.config.cluster_url.host()?;
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()
    }
}

/// What the agent was told about the API server.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// `--kubeconfig`.
    pub flag_kubeconfig: Option<PathBuf>,
    /// `clientConnection.kubeconfig`.
    pub config_kubeconfig: Option<PathBuf>,
    /// `--master`.
    pub master: Option<String>,
}

/// Chooses the client configuration as kube-proxy does (see the module doc).
pub async fn resolve(request: &Request) -> Result<Target, String> {
    let kubeconfig = request
        .flag_kubeconfig
        .clone()
        .or_else(|| request.config_kubeconfig.clone())
        .filter(|p| !p.as_os_str().is_empty());
    let master = request.master.clone().filter(|m| !m.trim().is_empty());
    let (mut config, origin) = match (kubeconfig, master) {
        (Some(path), master) => (from_file(&path, master.as_deref()).await?, Origin::Kubeconfig(path)),
        (None, Some(master)) => (with_service_account(&master).await?, Origin::Master),
        (None, None) if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => (
            kube::Config::incluster().map_err(|e| {
                format!("in-cluster configuration: {e} (the ServiceAccount token and CA belong in {SERVICE_ACCOUNT_DIR})")
            })?,
            Origin::InCluster,
        ),
        (None, None) => (
            kube::Config::infer().await.map_err(|e| {
                format!(
                    "no API server configured ({e}); use --kubeconfig, clientConnection.kubeconfig, \
                     --master, run in a cluster, or use --from-file"
                )
            })?,
            Origin::Local,
        ),
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    Ok(Target { config, origin })
}

async fn from_file(path: &Path, master: Option<&str>) -> Result<kube::Config, String> {
    let named = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| named(&e))?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| named(&e))?;
    if let Some(master) = master {
        config.cluster_url = master
            .parse()
            .map_err(|e| format!("--master {master:?}: {e}"))?;
    }
    Ok(config)
}

/// `--master` with the service account's token and CA: the kubeconfig kubeadm writes for
/// kube-proxy, with this server.
async fn with_service_account(master: &str) -> Result<kube::Config, String> {
    let dir = Path::new(SERVICE_ACCOUNT_DIR);
    let yaml = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: default\n  cluster:\n    server: {master:?}\n    certificate-authority: {ca:?}\nusers:\n- name: default\n  user:\n    tokenFile: {token:?}\ncontexts:\n- name: default\n  context: {{cluster: default, user: default}}\ncurrent-context: default\n",
        ca = dir.join("ca.crt").display().to_string(),
        token = dir.join("token").display().to_string(),
    );
    let kubeconfig =
        Kubeconfig::from_yaml(&yaml).map_err(|e| format!("--master {master:?}: {e}"))?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| {
            format!("--master {master:?} with the service account in {SERVICE_ACCOUNT_DIR}: {e}")
        })
}

/// The `default/kubernetes` Service's ClusterIP as the kubelet announces it to every container
/// (`KUBERNETES_PORT=tcp://10.96.0.1:443`). Overriding `KUBERNETES_SERVICE_HOST` leaves it in
/// place, so it still tells the ClusterIP apart from the control plane's address.
pub fn kubernetes_service_ip(env: impl Fn(&str) -> Option<String>) -> Option<IpAddr> {
    if let Some(addr) = env("KUBERNETES_PORT_443_TCP_ADDR")
        && let Ok(ip) = addr.trim().parse()
    {
        return Some(ip);
    }
    let port = env("KUBERNETES_PORT")?;
    let hostport = port.trim().strip_prefix("tcp://")?;
    let host = match hostport.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => hostport,
    };
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// Why `target` may be out of reach until nftproxy's own rules exist, if it is: its server is
/// the `kubernetes` Service's ClusterIP (from the in-cluster configuration or the kubelet's
/// variables), a ClusterIP of a known Service, or inside a known ServiceCIDR.
pub fn cluster_ip_problem(
    target: &Target,
    kubernetes_ip: Option<IpAddr>,
    cluster: &Cluster,
) -> Option<String> {
    let ip = target.server_ip()?;
    let why = if kubernetes_ip == Some(ip) || target.origin == Origin::InCluster {
        "the ClusterIP of the default/kubernetes Service (the in-cluster address)".to_string()
    } else if let Some(svc) = cluster
        .services
        .iter()
        .find(|(_, s)| s.cluster_ips.contains(&ip))
        .map(|(name, _)| name.to_string())
    {
        format!("the ClusterIP of Service {svc}")
    } else if let Some(cidr) = cluster
        .service_cidrs
        .values()
        .flatten()
        .find(|net| net.contains(&ip))
    {
        format!("inside ServiceCIDR {cidr}")
    } else {
        return None;
    };
    Some(format!(
        "the API server address {server} is {why}, which only a running Service proxy makes \
         reachable, and nftproxy is this node's Service proxy. Give nftproxy the control \
         plane's address: set KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT in the \
         nftproxy-api-server ConfigMap (packaging/configmap.yaml), or pass --master, or point \
         --kubeconfig / clientConnection.kubeconfig at a kubeconfig with the real endpoint \
         (kubeadm's kube-proxy ConfigMap has one)",
        server = target.server()
    ))
}

// ---------------------------------------------------------------------------------------------
// The client stack.

/// An answer must start within this time, or the request fails (and is retried on a new
/// connection). The API server's priority and fairness queues a request for at most about 15 s
/// before it rejects it with 429, and a page of 500 objects from its watch cache takes well under
/// a second, so a server that has said nothing after 30 s is not about to; the server's own limit
/// for a request is 60 s. Watches answer their head at once, so the same bound applies.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// The body of a list (or any answer but a watch) must not pause longer than this.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// TCP keepalive: probes after 30 s of silence (client-go's dialer uses 30 s), every 10 s; 3
/// unanswered ones end the connection, so a dead peer is noticed within about a minute, on a
/// quiet watch or an idle pooled connection alike.
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(30);
const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const TCP_KEEPALIVE_PROBES: u32 = 3;

/// Idle pooled connections are closed after this (hyper's default, made explicit: the pool
/// needs a timer to enforce it).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The shortest a watch may be silent before the watchdog ends it. A watch is never ended for
/// less than [`BOOKMARK_ALLOWANCE`] bookmark intervals of silence, nor for less than this.
pub const WATCH_BOUND_MIN: Duration = Duration::from_secs(5);

/// The longest. Real API servers send a bookmark about every minute; 150 s is two and a half of
/// those intervals. Until a resource's watches have carried a bookmark, its cadence is unknown
/// and kube-runtime's own idle timeout (the server-side watch timeout plus 5 s, at most 295 s)
/// is the only bound, so a server that sends no bookmarks has its quiet watches left alone.
pub const WATCH_BOUND_MAX: Duration = Duration::from_secs(150);

/// How many bookmark intervals of silence end a watch.
pub const BOOKMARK_ALLOWANCE: u32 = 3;

/// The bookmark intervals remembered per resource (the longest of them counts).
const BOOKMARK_GAPS: usize = 8;

/// A `Retry-After` is handed to the watcher that made the request within this time.
const RETRY_AFTER_FRESH: Duration = Duration::from_secs(10);

/// The longest `Retry-After` honoured.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);

/// The stack under [`ClientBuilder`]: kube's base URI, authentication and extra headers over a
/// pooled hyper client, under the [`Guard`].
pub type Stack =
    Guard<BoxCloneService<HttpRequest<kube::client::Body>, Response<Incoming>, BoxError>>;

/// The API client's stack, built from kube's public parts as `ClientBuilder::try_from` builds
/// it (that offers no TCP keepalive): TLS, the base URI, authentication (token files re-read)
/// and extra headers over a pooled hyper client whose connections have a connect timeout and
/// TCP keepalive, under the [`Guard`] (response and body timeouts, the watch watchdog, lists
/// from the watch cache, answers and `Retry-After` reported to `liveness`). Layers added on top
/// (metrics, rate limit) see its timeouts as failed requests, and its time does not include
/// their waits. Left out: kube's retry of 429/503/504 inside the stack (the watchers retry
/// with a delay that depends on the failure, `watch::Retry`, and every attempt is counted as
/// client-go counts it) and its tracing spans.
///
/// kube 5 speaks HTTP/1.1 only (its rustls connector offers no `h2`), so HTTP/2 health-check
/// pings do not apply; TCP keepalive and the timeouts here do that work.
pub fn client_builder(
    config: &kube::Config,
    liveness: Arc<Liveness>,
) -> Result<ClientBuilder<Stack>, String> {
    if let Some(proxy) = &config.proxy_url {
        return Err(format!(
            "proxy-url {proxy}: connecting through a proxy is not supported"
        ));
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(config.connect_timeout);
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.set_keepalive_interval(Some(TCP_KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(TCP_KEEPALIVE_PROBES));
    let https = config
        .rustls_https_connector_with_connector(http)
        .map_err(|e| format!("API client TLS: {e}"))?;
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(TokioTimer::new())
        .build(https);
    let auth = config
        .auth_layer()
        .map_err(|e| format!("API client credentials: {e}"))?;
    let headers = config
        .extra_headers_layer()
        .map_err(|e| format!("API client headers: {e}"))?;
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(auth)
        .layer(headers)
        .map_err(BoxError::from)
        .service(client);
    Ok(ClientBuilder::new(
        Guard::new(BoxCloneService::new(service), liveness),
        config.default_namespace.clone(),
    ))
}

/// What the client stack learns about the API server, per resource path (e.g.
/// `/api/v1/services`), for the watchers: that it answered, when it asked to be retried, and how
/// often its watches send bookmarks.
pub struct Liveness {
    paths: Mutex<HashMap<String, Arc<PathState>>>,
    /// The watch bound's range: [`WATCH_BOUND_MIN`] and [`WATCH_BOUND_MAX`].
    bounds: (Duration, Duration),
}

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness::with_watch_bounds(WATCH_BOUND_MIN, WATCH_BOUND_MAX)
    }
}

struct PathState {
    /// Bumped on every successful (2xx) answer.
    answered: tokio::sync::watch::Sender<u64>,
    /// The last `Retry-After`: when it came and what it said.
    retry_after: Mutex<Option<(Instant, Duration)>>,
    progress: Mutex<Progress>,
}

/// The value behind `m`, also after a panic while it was held (every user leaves it whole).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Liveness {
    /// Watch bounds other than [`WATCH_BOUND_MIN`] and [`WATCH_BOUND_MAX`] (for tests).
    pub fn with_watch_bounds(min: Duration, max: Duration) -> Liveness {
        Liveness {
            paths: Mutex::default(),
            bounds: (min, max.max(min)),
        }
    }

    fn state(&self, path: &str) -> Arc<PathState> {
        lock(&self.paths)
            .entry(path.to_string())
            .or_insert_with(|| {
                Arc::new(PathState {
                    answered: tokio::sync::watch::Sender::new(0),
                    retry_after: Mutex::new(None),
                    progress: Mutex::new(Progress::new(self.bounds)),
                })
            })
            .clone()
    }

    /// Changes whenever a request for `path` gets a successful answer (a list page, a watch
    /// that starts).
    pub fn answered(&self, path: &str) -> tokio::sync::watch::Receiver<u64> {
        self.state(path).answered.subscribe()
    }

    /// What is left of the `Retry-After` the server sent with its last 429 or 5xx for `path`,
    /// if that came within the last few seconds; taken, so it counts once.
    pub fn retry_after(&self, path: &str) -> Option<Duration> {
        let state = self.state(path);
        let (at, after) = lock(&state.retry_after).take()?;
        let age = at.elapsed();
        (age < RETRY_AFTER_FRESH).then(|| after.saturating_sub(age))
    }

    /// How long a watch of `path` may send nothing before the watchdog ends it:
    /// [`BOOKMARK_ALLOWANCE`] times the longest recent interval between the server's bookmarks,
    /// within [`WATCH_BOUND_MIN`]..=[`WATCH_BOUND_MAX`], doubled (up to the maximum) each time
    /// the watchdog fires until bookmarks are seen again; none until a bookmark has been seen.
    pub fn watch_bound(&self, path: &str) -> Option<Duration> {
        lock(&self.state(path).progress).bound
    }
}

/// The bookmark cadence of one resource's watches.
#[derive(Debug)]
struct Progress {
    gaps: VecDeque<Duration>,
    bound: Option<Duration>,
    /// The bound's range.
    min: Duration,
    max: Duration,
}

impl Progress {
    fn new((min, max): (Duration, Duration)) -> Progress {
        Progress {
            gaps: VecDeque::new(),
            bound: None,
            min,
            max,
        }
    }

    fn bookmark(&mut self, gap: Duration) {
        if self.gaps.len() == BOOKMARK_GAPS {
            self.gaps.pop_front();
        }
        self.gaps.push_back(gap);
        let longest = self.gaps.iter().max().copied().unwrap_or(self.max);
        self.bound = Some(
            longest
                .saturating_mul(BOOKMARK_ALLOWANCE)
                .clamp(self.min, self.max),
        );
    }

    /// The watchdog fired: the cadence may have changed, so allow more until bookmarks are seen
    /// again (a server that sends them less often is not restarted over and over).
    fn silent(&mut self) {
        self.gaps.clear();
        self.bound = self.bound.map(|b| b.saturating_mul(2).min(self.max));
    }
}

/// A request that took too long, as the [`Guard`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Timeout {
    /// No answer started within [`RESPONSE_TIMEOUT`].
    Response(Duration),
    /// The answer's body paused longer than [`BODY_TIMEOUT`].
    Body(Duration),
    /// A watch sent neither an event nor a bookmark for this long.
    Watch(Duration),
}

impl std::fmt::Display for Timeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Timeout::Response(d) => write!(f, "no answer from the API server within {d:?}"),
            Timeout::Body(d) => write!(f, "the API server's answer stalled for {d:?}"),
            Timeout::Watch(d) => write!(
                f,
                "watch watchdog: no event and no bookmark for {d:?}; restarting the watch"
            ),
        }
    }
}

impl std::error::Error for Timeout {}

/// The layer of [`client_builder`]; see [`Stack`].
#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    liveness: Arc<Liveness>,
    response_timeout: Duration,
    body_timeout: Duration,
}

impl<S> Guard<S> {
    pub fn new(inner: S, liveness: Arc<Liveness>) -> Guard<S> {
        Guard {
            inner,
            liveness,
            response_timeout: RESPONSE_TIMEOUT,
            body_timeout: BODY_TIMEOUT,
        }
    }

    /// Other timeouts (for tests).
    pub fn with_timeouts(mut self, response: Duration, body: Duration) -> Guard<S> {
        self.response_timeout = response;
        self.body_timeout = body;
        self
    }
}

/// Whether `uri` asks for a watch.
pub(crate) fn is_watch(uri: &Uri) -> bool {
    query_has(uri, |kv| kv == "watch=true" || kv == "watch=1")
}

/// Whether a `key=value` pair of `uri`'s query satisfies `f`.
pub(crate) fn query_has(uri: &Uri, f: impl Fn(&str) -> bool) -> bool {
    uri.query().is_some_and(|q| q.split('&').any(f))
}

/// The first page of a list from the API server's watch cache, as client-go's reflector asks
/// for it: `resourceVersion=0` with `limit=500`. kube-core leaves `resourceVersion=0` out when a
/// limit is set (kube-rs#1743: the watch cache does not page), which would make every
/// paginated list a quorum read from etcd; client-go sends both, the watch cache answers the
/// whole list at once and a server without one pages. Further pages (`continue=`) carry no
/// resourceVersion, as they must.
fn list_from_watch_cache<B>(req: &mut HttpRequest<B>) {
    let uri = req.uri();
    let first_page = req.method() == hyper::Method::GET
        && query_has(uri, |kv| kv.starts_with("limit="))
        && !query_has(uri, |kv| {
            kv.starts_with("resourceVersion=")
                || kv.starts_with("continue=")
                || kv.starts_with("watch=")
        });
    if !first_page {
        return;
    }
    let Some(pq) = uri.path_and_query() else {
        return;
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = format!("{pq}&resourceVersion=0").parse().ok();
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    }
}

/// `Retry-After`: seconds, or an HTTP date.
fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or_default())
}

impl<S, ReqBody, ResBody> tower::Service<HttpRequest<ReqBody>> for Guard<S>
where
    S: tower::Service<HttpRequest<ReqBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<GuardBody<ResBody>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: HttpRequest<ReqBody>) -> Self::Future {
        list_from_watch_cache(&mut req);
        let watch = is_watch(req.uri());
        let state = self.liveness.state(req.uri().path());
        let (response_timeout, body_timeout) = (self.response_timeout, self.body_timeout);
        let answer = self.inner.call(req);
        Box::pin(async move {
            let resp = match tokio::time::timeout(response_timeout, answer).await {
                Err(_) => return Err(Box::new(Timeout::Response(response_timeout)) as BoxError),
                Ok(Err(e)) => return Err(e.into()),
                Ok(Ok(resp)) => resp,
            };
            let status = resp.status();
            if status.is_success() {
                state.answered.send_modify(|n| *n = n.wrapping_add(1));
            } else if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
                let after = resp
                    .headers()
                    .get(hyper::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_retry_after);
                *lock(&state.retry_after) = after.map(|a| (Instant::now(), a.min(RETRY_AFTER_MAX)));
            }
            let watch = (watch && status.is_success()).then(|| WatchProgress {
                last_bookmark: Instant::now(),
                line: Vec::new(),
                long_line: false,
                state,
            });
            let idle = match &watch {
                Some(w) => lock(&w.state.progress).bound,
                None => Some(body_timeout),
            };
            Ok(resp.map(|inner| GuardBody {
                inner,
                timer: idle.map(|idle| Box::pin(tokio::time::sleep(idle))),
                body_timeout,
                watch,
                done: false,
            }))
        })
    }
}

/// A response body that fails when it pauses too long: [`BODY_TIMEOUT`] for an answer, the
/// watch bound ([`Liveness::watch_bound`]) for a watch. A watch's bookmarks teach the bound.
pub struct GuardBody<B> {
    inner: B,
    /// None: a watch whose bookmark cadence is not known yet.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    body_timeout: Duration,
    watch: Option<WatchProgress>,
    done: bool,
}

struct WatchProgress {
    state: Arc<PathState>,
    last_bookmark: Instant,
    /// The start of the current line (bookmarks are short lines).
    line: Vec<u8>,
    long_line: bool,
}

/// Bookmark lines are a few hundred bytes; longer lines are objects.
const BOOKMARK_LINE_MAX: usize = 4096;

impl WatchProgress {
    /// Looks for BOOKMARK events in a chunk of the watch's JSON lines.
    fn scan(&mut self, data: &[u8]) {
        let mut rest = data;
        while let Some(nl) = rest.iter().position(|b| *b == b'\n') {
            self.push(&rest[..nl]);
            if !self.long_line && is_bookmark(&self.line) {
                let now = Instant::now();
                let gap = now.saturating_duration_since(self.last_bookmark);
                self.last_bookmark = now;
                lock(&self.state.progress).bookmark(gap);
            }
            self.line.clear();
            self.long_line = false;
            rest = &rest[nl + 1..];
        }
        self.push(rest);
    }

    fn push(&mut self, part: &[u8]) {
        if self.long_line || self.line.len() + part.len() > BOOKMARK_LINE_MAX {
            self.long_line = true;
            self.line.clear();
        } else {
            self.line.extend_from_slice(part);
        }
    }
}

/// Whether a watch event line is a bookmark (`{"type":"BOOKMARK","object":...}`, keys in
/// either order, as Go and serde write them).
fn is_bookmark(line: &[u8]) -> bool {
    const NEEDLE: &[u8] = br#""type":"BOOKMARK""#;
    line.windows(NEEDLE.len()).any(|w| w == NEEDLE)
}

impl<B> Body for GuardBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let idle = match &mut this.watch {
                    Some(w) => {
                        if let Some(data) = frame.data_ref() {
                            w.scan(data);
                        }
                        lock(&w.state.progress).bound
                    }
                    None => Some(this.body_timeout),
                };
                let deadline = idle.map(|idle| tokio::time::Instant::now() + idle);
                match (deadline, &mut this.timer) {
                    (Some(at), Some(timer)) => timer.as_mut().reset(at),
                    (Some(at), None) => this.timer = Some(Box::pin(tokio::time::sleep_until(at))),
                    (None, _) => this.timer = None,
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let expired = match &mut this.timer {
                    Some(timer) => timer.as_mut().poll(cx).is_ready(),
                    None => false,
                };
                if !expired {
                    return Poll::Pending;
                }
                this.done = true;
                let timeout = match &this.watch {
                    Some(w) => {
                        let mut progress = lock(&w.state.progress);
                        let bound = progress.bound.unwrap_or_default();
                        progress.silent();
                        Timeout::Watch(bound)
                    }
                    None => Timeout::Body(this.body_timeout),
                };
                Poll::Ready(Some(Err(Box::new(timeout))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests;
