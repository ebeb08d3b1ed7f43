//! Watches the API server (kube-runtime watchers) and feeds the change tracker.
//!
//! Each watcher lists from the API server's watch cache (`resourceVersion=0`, pages of 500,
//! as client-go's informers do) and retries on its own with a delay that depends on the
//! failure ([`Retry`]): a server out of reach is retried within 2 s, an overloaded one backs
//! off up to 30 s (longer if its `Retry-After` says so), and an expired resourceVersion (410)
//! is relisted at once. The client stack (`apiclient::client_builder`) bounds every request in
//! time and ends watches that go silent; its [`Liveness`] tells the watchers when the server
//! answers again, which resets their backoff.
//!
//! Each watcher runs in a task of its own that asks for the next list page while the tracker
//! converts the current one ([`PREFETCH`]), and the tracker takes the events in batches
//! ([`BATCH`]): a cold start lists at about the speed of the server and the decode.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use dataplane::convert::Skipped;
use dataplane::model::{Cluster, ObjectName};
use dataplane::tracker::{Kind, Tracker};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio_util::task::AbortOnDropHandle;

use crate::apiclient::{Liveness, RETRY_AFTER_MAX};
use crate::syncloop::Shared;

/// kube-proxy's selector for Services and EndpointSlices (the EndpointSlice controller copies
/// a Service's labels to its slices and marks those of headless Services): objects handled by
/// another proxy, and headless Services and their slices, are not even listed.
pub const SERVICE_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// Objects per list page (client-go's pager default).
pub const LIST_PAGE_SIZE: u32 = 500;

/// The server ends each watch after a random time in this range (seconds; kube-core allows at
/// most 294), so that thousands of nodes that started together do not all re-watch together.
/// kube-runtime resumes the watch from its resourceVersion.
const WATCH_TIMEOUT_SECS: (u32, u32) = (240, 290);

/// Retries after the server could not be reached or stopped answering: the first after
/// 100–200 ms, doubling, at most 1–2 s apart.
pub const FAST_RETRY: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(2));

/// Retries after the server said no (429, 5xx, or an error that retrying soon will not fix):
/// the first after 0.5–1 s, doubling, at most 15–30 s apart.
pub const SLOW_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// The reason the API server is out of reach, given the cluster known so far, if its address
/// has a known problem.
type Explain = Box<dyn Fn(&Cluster) -> Option<String> + Send + Sync>;

/// Names what keeps the API server out of reach, when that is known, once per outage: in the
/// log and in `/healthz`. Carries what the client stack saw of the server ([`Liveness`]) to
/// the watchers.
pub struct Diagnosis {
    explain: Explain,
    reported: AtomicBool,
    liveness: Arc<Liveness>,
}

impl Diagnosis {
    pub fn new(explain: impl Fn(&Cluster) -> Option<String> + Send + Sync + 'static) -> Diagnosis {
        Diagnosis {
            explain: Box::new(explain),
            reported: AtomicBool::new(false),
            liveness: Arc::default(),
        }
    }

    /// The client stack's [`Liveness`] (`apiclient::client_builder`).
    pub fn with_liveness(mut self, liveness: Arc<Liveness>) -> Diagnosis {
        self.liveness = liveness;
        self
    }

    fn failed(&self, shared: &Shared, error: &watcher::Error) {
        // A server that answers, even with an error, is reachable.
        let unreachable = match error {
            watcher::Error::InitialListFailed(e)
            | watcher::Error::WatchStartFailed(e)
            | watcher::Error::WatchFailed(e) => !matches!(e, kube::Error::Api(_)),
            watcher::Error::WatchError(_) | watcher::Error::NoResourceVersion => false,
        };
        if !unreachable {
            return;
        }
        let Some(problem) = shared.with_tracker(|t| (self.explain)(t.cluster())) else {
            return;
        };
        if !self.reported.swap(true, Ordering::Relaxed) {
            tracing::error!(error = %error, "cannot reach the API server: {problem}");
        }
        shared.health().set_api_problem(Some(problem));
    }

    fn recovered(&self, shared: &Shared) {
        if self.reported.swap(false, Ordering::Relaxed) {
            shared.health().set_api_problem(None);
        }
    }
}

/// Runs all watchers until the process ends. Each retries on its own; a cluster that does not
/// serve ServiceCIDRs is tolerated.
pub async fn run(
    client: Client,
    node_name: String,
    shared: Arc<Shared>,
    diagnosis: Arc<Diagnosis>,
) {
    let services = watch(
        Api::<Service>::all(client.clone()),
        config().labels(SERVICE_SELECTOR),
        Kind::Service,
        (shared.clone(), diagnosis.clone()),
        |t, o| t.apply_service(o),
    );
    let slices = watch(
        Api::<EndpointSlice>::all(client.clone()),
        config().labels(SERVICE_SELECTOR),
        Kind::EndpointSlice,
        (shared.clone(), diagnosis.clone()),
        |t, o| t.apply_slice(o),
    );
    let node = watch(
        Api::<Node>::all(client.clone()),
        config().fields(&format!("metadata.name={node_name}")),
        Kind::Node,
        (shared.clone(), diagnosis.clone()),
        |t, o| t.apply_node(o),
    );
    let cidrs = watch(
        Api::<ServiceCIDR>::all(client),
        config(),
        Kind::ServiceCidr,
        (shared, diagnosis),
        |t, o| t.apply_service_cidr(o),
    );
    futures::join!(services, slices, node, cidrs);
}

/// A watcher's configuration: lists from the watch cache in pages, bookmarks (kube-runtime's
/// default), a randomised server-side watch timeout.
fn config() -> watcher::Config {
    let (low, high) = WATCH_TIMEOUT_SECS;
    let spread = f64::from(high - low) * Jitter::seeded(u64::from(low)).next();
    watcher::Config::default()
        .any_semantic()
        .page_size(LIST_PAGE_SIZE)
        .timeout(low + spread as u32)
}

fn name_of<K: Resource>(obj: &K) -> ObjectName {
    ObjectName::new(
        obj.meta().namespace.as_deref().unwrap_or(""),
        obj.meta().name.as_deref().unwrap_or(""),
    )
}

fn is_not_found(err: &watcher::Error) -> bool {
    match err {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        _ => false,
    }
}

/// What kind of failure a watcher saw, for how soon to try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The server was not reached or stopped answering: connection refused or reset, a
    /// timeout, a watch gone silent. Retried quickly ([`FAST_RETRY`]).
    Unreachable,
    /// The server answered 429 or 5xx: overloaded or unwell. Backs off ([`SLOW_RETRY`]),
    /// never sooner than its `Retry-After`.
    Overloaded,
    /// 410 Gone: the resourceVersion is older than the server's history. Relisted at once.
    Expired,
    /// Anything else the server said (401, 403, 404, 422, an object that does not decode):
    /// retrying soon will not help ([`SLOW_RETRY`]).
    Refused,
}

impl Failure {
    pub fn of(error: &watcher::Error) -> Failure {
        match error {
            watcher::Error::InitialListFailed(e)
            | watcher::Error::WatchStartFailed(e)
            | watcher::Error::WatchFailed(e) => match e {
                kube::Error::Api(s) => Failure::of_status(s.code),
                kube::Error::SerdeError(_)
                | kube::Error::FromUtf8(_)
                | kube::Error::LinesCodecMaxLineLengthExceeded
                | kube::Error::BuildRequest(_)
                | kube::Error::HttpError(_)
                | kube::Error::Auth(_) => Failure::Refused,
                _ => Failure::Unreachable,
            },
            watcher::Error::WatchError(s) => Failure::of_status(s.code),
            watcher::Error::NoResourceVersion => Failure::Refused,
        }
    }

    fn of_status(code: u16) -> Failure {
        match code {
            410 => Failure::Expired,
            429 | 500..=599 => Failure::Overloaded,
            _ => Failure::Refused,
        }
    }
}

/// The `Retry-After` an error carries in its `Status` (`details.retryAfterSeconds`, which the
/// API server sets with its 429s).
fn status_retry_after(error: &watcher::Error) -> Option<Duration> {
    let status = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s))
        | watcher::Error::WatchError(s) => s,
        _ => return None,
    };
    let secs = status.details.as_ref()?.retry_after_seconds;
    (secs > 0).then(|| Duration::from_secs(u64::from(secs)))
}

/// Whether kube-runtime would retry this watch from the same resourceVersion forever: a 410
/// answered to the watch request itself (the usual 410 comes inside the stream, and
/// kube-runtime relists after it). The watcher is started afresh instead.
fn needs_relist(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 410)
}

/// The delays between a watcher's retries, by [`Failure`]: exponential with "equal jitter" (a
/// random delay in [d/2, d]), so that thousands of nodes that lost the server together do not
/// come back in step. Reset when the server answers.
#[derive(Debug)]
pub struct Retry {
    unreachable: u32,
    overloaded: u32,
    refused: u32,
    jitter: Jitter,
}

impl Retry {
    pub fn new(seed: u64) -> Retry {
        Retry {
            unreachable: 0,
            overloaded: 0,
            refused: 0,
            jitter: Jitter::seeded(seed),
        }
    }

    /// The delay before the next try after `failure`; `retry_after` is what the server asked.
    pub fn delay(&mut self, failure: Failure, retry_after: Option<Duration>) -> Duration {
        let (n, (first, max)) = match failure {
            Failure::Expired => return Duration::ZERO,
            Failure::Unreachable => (&mut self.unreachable, FAST_RETRY),
            Failure::Overloaded => (&mut self.overloaded, SLOW_RETRY),
            Failure::Refused => (&mut self.refused, SLOW_RETRY),
        };
        let full = first.saturating_mul(1 << (*n).min(20)).min(max);
        *n = n.saturating_add(1);
        let delay = full.mul_f64(0.5 + 0.5 * self.jitter.next());
        match (failure, retry_after) {
            (Failure::Overloaded, Some(after)) => delay.max(after.min(RETRY_AFTER_MAX)),
            _ => delay,
        }
    }

    /// The server answered: the next failure starts from the first delay again.
    pub fn reset(&mut self) {
        self.unreachable = 0;
        self.overloaded = 0;
        self.refused = 0;
    }
}

/// A small pseudo-random sequence in [0, 1) (xorshift64*), seeded from the clock, the process
/// and a salt: enough to spread retries apart.
#[derive(Debug)]
struct Jitter(u64);

impl Jitter {
    fn seeded(salt: u64) -> Jitter {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let seed = nanos
            ^ (u64::from(std::process::id()) << 32)
            ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        Jitter(seed | 1)
    }

    fn next(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One watcher's view of its failures: logged once per outage (the first loudly, the rest
/// quietly), its retry delays, the diagnosis.
struct Outage<'a> {
    kind: Kind,
    failing: bool,
    retry: Retry,
    shared: &'a Shared,
    diagnosis: &'a Diagnosis,
}

impl Outage<'_> {
    /// The server answered (a list page, a watch that started, an event).
    fn answered(&mut self) {
        self.retry.reset();
        if self.failing {
            tracing::info!(kind = self.kind.name(), "watch recovered");
            self.failing = false;
        }
        self.diagnosis.recovered(self.shared);
    }

    /// How long to wait after `error`.
    fn failed(&mut self, error: &watcher::Error, retry_after: Option<Duration>) -> Duration {
        let failure = Failure::of(error);
        let retry_after = retry_after.or_else(|| status_retry_after(error));
        let delay = self.retry.delay(failure, retry_after);
        let kind = self.kind.name();
        if failure == Failure::Expired {
            // Normal after an outage or a long watch: kube-runtime relists.
            tracing::info!(kind, error = %error, "watch history expired; relisting");
        } else if self.failing {
            tracing::debug!(kind, error = %error, retry_in = ?delay, "watch still failing");
        } else {
            tracing::warn!(kind, error = %error, retry_in = ?delay, "watch failed; retrying");
            self.failing = true;
        }
        self.diagnosis.failed(self.shared, error);
        delay
    }
}

/// Events the fetcher may hold for the tracker: two list pages. While the tracker converts one
/// page, the next is already asked for and decoded (kube-runtime's watcher asks for a page only
/// once the previous one is taken), so a cold start lists at close to the speed of the server
/// and the decode, not of the decode plus the conversion. Bounded, so that a slow tracker holds
/// back the list instead of buffering it whole.
const PREFETCH: usize = 2 * LIST_PAGE_SIZE as usize;

/// Events applied under one lock of the tracker, followed by one wake-up of the sync loop: few
/// enough that the sync loop never waits long for the tracker (about 2–5 ms of conversion).
const BATCH: usize = 128;

/// What the fetcher hands to the tracker.
enum Fed<K> {
    Event(Event<K>),
    /// The server does not serve this kind (ServiceCIDRs on older clusters).
    Absent,
}

/// One watcher: a task that fetches (lists page by page, then watches, retrying on failure)
/// feeds the tracker here through a bounded channel, in batches.
async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    (shared, diagnosis): (Arc<Shared>, Arc<Diagnosis>),
    apply: fn(&mut Tracker, &K) -> Option<Skipped>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel(PREFETCH);
    // Aborted when dropped: the watchers end with the process, or a test's runtime.
    let _fetcher = AbortOnDropHandle::new(tokio::spawn(fetch(
        api,
        config,
        kind,
        (shared.clone(), diagnosis),
        tx,
    )));
    let mut batch = Vec::with_capacity(BATCH);
    // The list in progress: when it started, its objects so far and the time spent applying
    // them to the tracker (the rest is the server, the transfer and the decode).
    let mut listing: Option<(Instant, usize, Duration)> = None;
    while rx.recv_many(&mut batch, BATCH).await > 0 {
        let started = Instant::now();
        let skipped: Vec<Skipped> = shared.with_tracker(|t| {
            batch
                .iter()
                .filter_map(|fed| feed(t, kind, fed, apply))
                .collect()
        });
        let applying = started.elapsed();
        for fed in &batch {
            match fed {
                Fed::Event(Event::Init) => listing = Some((started, 0, Duration::ZERO)),
                Fed::Event(Event::InitApply(_)) => {
                    if let Some((_, n, _)) = &mut listing {
                        *n += 1;
                    }
                }
                Fed::Event(Event::InitDone) => {
                    if let Some((start, objects, applied)) = listing.take() {
                        tracing::info!(
                            kind = kind.name(),
                            objects,
                            seconds = start.elapsed().as_secs_f64(),
                            applying_seconds = (applied + applying).as_secs_f64(),
                            "listed"
                        );
                    }
                }
                _ => {}
            }
        }
        if let Some((_, _, applied)) = &mut listing {
            *applied += applying;
        }
        for s in skipped {
            tracing::warn!(kind = %s.kind, name = %s.name, reason = %s.skip, "skipping invalid object");
        }
        for fed in &batch {
            if let Fed::Event(Event::Apply(o) | Event::Delete(o)) = fed {
                tracing::debug!(kind = kind.name(), name = %o.name_any(), "change");
            }
        }
        batch.clear();
        shared.changed();
    }
}

/// Applies one fetched event to the tracker.
fn feed<K: Resource>(
    t: &mut Tracker,
    kind: Kind,
    fed: &Fed<K>,
    apply: fn(&mut Tracker, &K) -> Option<Skipped>,
) -> Option<Skipped> {
    match fed {
        Fed::Event(Event::Init) => {
            t.begin_list(kind);
            None
        }
        Fed::Event(Event::InitApply(o) | Event::Apply(o)) => apply(t, o),
        Fed::Event(Event::InitDone) => {
            t.end_list(kind);
            None
        }
        Fed::Event(Event::Delete(o)) => {
            t.delete(kind, &name_of(o));
            None
        }
        Fed::Absent => {
            t.begin_list(kind);
            t.end_list(kind);
            None
        }
    }
}

/// Runs kube-runtime's watcher for one kind and sends its events to `tx` until `tx` closes;
/// failures are retried here ([`Outage`]), so the stream is not polled during a backoff.
async fn fetch<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    (shared, diagnosis): (Arc<Shared>, Arc<Diagnosis>),
    tx: tokio::sync::mpsc::Sender<Fed<K>>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let path = api.resource_url().to_string();
    let liveness = diagnosis.liveness.clone();
    let mut answered = liveness.answered(&path);
    let start = || watcher(api.clone(), config.clone()).boxed();
    let mut stream = start();
    let mut outage = Outage {
        kind,
        failing: false,
        retry: Retry::new(kind as u64),
        shared: &shared,
        diagnosis: &diagnosis,
    };
    loop {
        let event = tokio::select! {
            biased;
            Ok(()) = answered.changed() => {
                outage.answered();
                continue;
            }
            event = stream.next() => event,
        };
        let Some(event) = event else {
            return;
        };
        let event = match event {
            Ok(e) => {
                // Init comes before the list is asked for: it proves nothing.
                if !matches!(e, Event::Init) {
                    outage.answered();
                }
                e
            }
            Err(e) if kind == Kind::ServiceCidr && is_not_found(&e) => {
                tracing::info!("the API server does not serve ServiceCIDRs; continuing without");
                let _ = tx.send(Fed::Absent).await;
                return;
            }
            Err(e) => {
                let delay = outage.failed(&e, liveness.retry_after(&path));
                if needs_relist(&e) {
                    stream = start();
                }
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                continue;
            }
        };
        if tx.send(Fed::Event(event)).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(Status::failure("x", "y").with_code(code)))
    }

    fn refused() -> kube::Error {
        kube::Error::Service(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )))
    }

    #[test]
    fn failures_are_told_apart() {
        use watcher::Error as E;
        assert_eq!(
            Failure::of(&E::WatchStartFailed(refused())),
            Failure::Unreachable
        );
        assert_eq!(
            Failure::of(&E::InitialListFailed(refused())),
            Failure::Unreachable
        );
        let silent = kube::Error::ReadEvents(std::io::Error::other("watchdog"));
        assert_eq!(Failure::of(&E::WatchFailed(silent)), Failure::Unreachable);
        for code in [429, 500, 503, 504] {
            assert_eq!(
                Failure::of(&E::InitialListFailed(api(code))),
                Failure::Overloaded
            );
        }
        assert_eq!(
            Failure::of(&E::WatchError(Box::new(
                Status::failure("gone", "Expired").with_code(410)
            ))),
            Failure::Expired
        );
        assert_eq!(
            Failure::of(&E::InitialListFailed(api(410))),
            Failure::Expired
        );
        assert_eq!(
            Failure::of(&E::InitialListFailed(api(403))),
            Failure::Refused
        );
        assert_eq!(Failure::of(&E::NoResourceVersion), Failure::Refused);
        assert!(needs_relist(&E::WatchStartFailed(api(410))));
        assert!(!needs_relist(&E::InitialListFailed(api(410))));
    }

    #[test]
    fn unreachable_is_retried_quickly_overload_backs_off() {
        let mut r = Retry::new(7);
        let fast: Vec<Duration> = (0..8)
            .map(|_| r.delay(Failure::Unreachable, None))
            .collect();
        assert!(fast[0] >= Duration::from_millis(100) && fast[0] <= Duration::from_millis(200));
        assert!(fast.iter().all(|d| *d <= FAST_RETRY.1), "{fast:?}");
        assert!(fast[7] >= FAST_RETRY.1 / 2, "{fast:?}");
        let slow: Vec<Duration> = (0..10)
            .map(|_| r.delay(Failure::Overloaded, None))
            .collect();
        assert!(slow[0] >= Duration::from_millis(500) && slow[0] <= Duration::from_secs(1));
        assert!(slow.iter().all(|d| *d <= SLOW_RETRY.1), "{slow:?}");
        assert!(slow[9] >= SLOW_RETRY.1 / 2, "{slow:?}");
        assert_eq!(r.delay(Failure::Expired, None), Duration::ZERO);
        r.reset();
        assert!(r.delay(Failure::Unreachable, None) <= Duration::from_millis(200));
        assert!(r.delay(Failure::Overloaded, None) <= Duration::from_secs(1));
    }

    #[test]
    fn retry_after_is_honoured() {
        let mut r = Retry::new(1);
        let d = r.delay(Failure::Overloaded, Some(Duration::from_secs(7)));
        assert_eq!(d, Duration::from_secs(7));
        // Never beyond the cap, never sooner than the backoff.
        let d = r.delay(Failure::Overloaded, Some(Duration::from_secs(3600)));
        assert_eq!(d, RETRY_AFTER_MAX);
        // Only for answers that asked for it.
        assert!(r.delay(Failure::Unreachable, Some(Duration::from_secs(60))) <= FAST_RETRY.1);
        let mut status = Status::failure("slow down", "TooManyRequests").with_code(429);
        status.details = serde_json::from_str(r#"{"retryAfterSeconds": 4}"#).unwrap();
        let e = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(status)));
        assert_eq!(status_retry_after(&e), Some(Duration::from_secs(4)));
    }

    #[test]
    fn jitter_spreads() {
        let mut j = Jitter::seeded(3);
        let xs: Vec<f64> = (0..1000).map(|_| j.next()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((0.4..0.6).contains(&mean), "{mean}");
    }
}
