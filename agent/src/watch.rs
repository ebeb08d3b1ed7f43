//! Watches the API server (kube-runtime watchers with backoff) and feeds the change tracker.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dataplane::convert::Skipped;
use dataplane::model::{Cluster, ObjectName};
use dataplane::tracker::{Kind, Tracker};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::syncloop::Shared;

/// kube-proxy's selector for Services and EndpointSlices (the EndpointSlice controller copies
/// a Service's labels to its slices and marks those of headless Services): objects handled by
/// another proxy, and headless Services and their slices, are not even listed.
pub const SERVICE_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The reason the API server is out of reach, given the cluster known so far, if its address
/// has a known problem.
type Explain = Box<dyn Fn(&Cluster) -> Option<String> + Send + Sync>;

/// Names what keeps the API server out of reach, when that is known, once per outage: in the
/// log and in `/healthz`.
pub struct Diagnosis {
    explain: Explain,
    reported: AtomicBool,
}

impl Diagnosis {
    pub fn new(explain: impl Fn(&Cluster) -> Option<String> + Send + Sync + 'static) -> Diagnosis {
        Diagnosis {
            explain: Box::new(explain),
            reported: AtomicBool::new(false),
        }
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

/// Runs all watchers until the process ends. Each retries with backoff on its own; a
/// cluster that does not serve ServiceCIDRs is tolerated.
pub async fn run(
    client: Client,
    node_name: String,
    shared: Arc<Shared>,
    diagnosis: Arc<Diagnosis>,
) {
    let services = watch(
        Api::<Service>::all(client.clone()),
        watcher::Config::default().labels(SERVICE_SELECTOR),
        Kind::Service,
        (shared.clone(), diagnosis.clone()),
        |t, o| t.apply_service(o),
    );
    let slices = watch(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(SERVICE_SELECTOR),
        Kind::EndpointSlice,
        (shared.clone(), diagnosis.clone()),
        |t, o| t.apply_slice(o),
    );
    let node = watch(
        Api::<Node>::all(client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        Kind::Node,
        (shared.clone(), diagnosis.clone()),
        |t, o| t.apply_node(o),
    );
    let cidrs = watch(
        Api::<ServiceCIDR>::all(client),
        watcher::Config::default(),
        Kind::ServiceCidr,
        (shared, diagnosis),
        |t, o| t.apply_service_cidr(o),
    );
    futures::join!(services, slices, node, cidrs);
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

async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: Kind,
    (shared, diagnosis): (Arc<Shared>, Arc<Diagnosis>),
    apply: fn(&mut Tracker, &K) -> Option<Skipped>,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let mut stream = watcher(api, config).default_backoff().boxed();
    let mut failing = false;
    while let Some(event) = stream.next().await {
        let event = match event {
            Ok(e) => {
                if failing {
                    tracing::info!(kind = kind.name(), "watch recovered");
                    failing = false;
                }
                diagnosis.recovered(&shared);
                e
            }
            Err(e) if kind == Kind::ServiceCidr && is_not_found(&e) => {
                tracing::info!("the API server does not serve ServiceCIDRs; continuing without");
                shared.with_tracker(|t| {
                    t.begin_list(kind);
                    t.end_list(kind);
                });
                return;
            }
            Err(e) => {
                // The backoff spaces retries out; log the first failure loudly, the rest quietly.
                if failing {
                    tracing::debug!(kind = kind.name(), error = %e, "watch still failing");
                } else {
                    tracing::warn!(kind = kind.name(), error = %e, "watch failed; retrying with backoff");
                    failing = true;
                }
                diagnosis.failed(&shared, &e);
                continue;
            }
        };
        let skipped = shared.with_tracker(|t| match &event {
            Event::Init => {
                t.begin_list(kind);
                None
            }
            Event::InitApply(o) | Event::Apply(o) => apply(t, o),
            Event::InitDone => {
                t.end_list(kind);
                None
            }
            Event::Delete(o) => {
                let name = name_of(o);
                t.delete(kind, &name);
                None
            }
        });
        if let Some(s) = skipped {
            tracing::warn!(kind = %s.kind, name = %s.name, reason = %s.skip, "skipping invalid object");
        }
        if let Event::Apply(o) | Event::Delete(o) = &event {
            tracing::debug!(kind = kind.name(), name = %o.name_any(), "change");
        }
        shared.changed();
    }
}
