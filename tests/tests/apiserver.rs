//! The in-memory API server against the real kube-rs client (list pages, selectors, writes,
//! the runtime watcher through 410 re-lists, refusals, stalls and restarts, bookmarks),
//! all inside a lab namespace. Needs root.

use std::future::Future;
use std::time::Duration;

use anyhow::Result;
use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::api::{Api, DeleteParams, ListParams, PostParams, VersionMatch, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::Event;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Config, ResourceExt};
use nftproxy_tests::apiserver::in_netns;
use nftproxy_tests::{ApiServer, Lab, Ns};
use serde_json::{Value, json};

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
const NOT_OTHER_PROXY: &str = "!service.kubernetes.io/service-proxy-name";

struct Env {
    _lab: Lab,
    node: Ns,
    api: ApiServer,
}

fn env() -> Env {
    assert!(
        nftproxy_tests::privilege::is_root(),
        "the namespace tests need root"
    );
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let api = ApiServer::start_in(&node).unwrap();
    Env {
        _lab: lab,
        node,
        api,
    }
}

/// Runs `f` with a kube client (from the server's kubeconfig, `read_timeout` set) on a
/// thread inside the node namespace.
fn client_side<F, Fut>(env: &Env, read_timeout: Option<Duration>, f: F)
where
    F: FnOnce(Client) -> Fut + Send,
    Fut: Future<Output = Result<()>>,
{
    in_netns(env.node.name(), || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let kubeconfig = Kubeconfig::read_from(env.api.kubeconfig())?;
            let mut config =
                Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
            config.read_timeout = read_timeout;
            f(Client::try_from(config)?).await
        })
    })
    .unwrap()
    .unwrap();
}

fn svc(ns: &str, name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"clusterIP": "172.30.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
    })
}

fn names<K: ResourceExt>(objs: &[K]) -> Vec<String> {
    objs.iter().map(|o| o.name_any()).collect()
}

#[test]
fn list_pages_selectors_and_writes() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &env.api;
    for i in 0..5 {
        api.apply(svc("default", &format!("svc-{i}"), json!({"app": "web"})))
            .unwrap();
    }
    api.apply_yaml(&format!(
        "kind: List
items:
- {{apiVersion: v1, kind: Service, metadata: {{name: dns, namespace: kube-system,
   labels: {{{PROXY_NAME}: other}}}}, spec: {{ports: [{{port: 53}}]}}}}
- {{apiVersion: v1, kind: Service, metadata: {{name: metrics, namespace: kube-system}},
   spec: {{ports: [{{port: 9090}}]}}}}
---
apiVersion: v1
kind: Node
metadata: {{name: node-a, labels: {{topology.kubernetes.io/zone: z1}}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc-0-abc, namespace: default, labels: {{kubernetes.io/service-name: svc-0}}}}
addressType: IPv4
endpoints: [{{addresses: [10.180.0.2], conditions: {{ready: true}}}}]
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {{name: kubernetes}}
spec: {{cidrs: [172.30.0.0/16]}}
"
    ))
    .unwrap();
    assert_eq!(api.resource_version(), 10);
    assert_eq!(
        api.get("Service", "kube-system", "dns").unwrap()["metadata"]["resourceVersion"],
        "6"
    );

    client_side(&env, None, |client| async move {
        assert_eq!(client.apiserver_version().await?.minor, "33");
        let groups = client.list_api_groups().await?;
        assert!(groups.groups.iter().any(|g| g.name == "discovery.k8s.io"));

        // Pages of 2 from one consistent snapshot, even with a write in between.
        let services: Api<Service> = Api::all(client.clone());
        let (mut seen, mut pages, mut token) = (Vec::new(), 0, None::<String>);
        loop {
            let mut lp = ListParams::default().limit(2);
            if let Some(t) = &token {
                lp = lp.continue_token(t);
            }
            let page = services.list(&lp).await?;
            assert_eq!(page.metadata.resource_version.as_deref(), Some("10"));
            seen.extend(names(&page.items));
            pages += 1;
            if pages == 1 {
                api.apply(svc("default", "svc-late", json!({})))?;
            }
            token = page.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                break;
            }
        }
        assert_eq!(pages, 4);
        assert_eq!(
            seen,
            [
                "svc-0", "svc-1", "svc-2", "svc-3", "svc-4", "dns", "metrics"
            ]
        );
        let all = services.list(&ListParams::default()).await?;
        assert_eq!(all.items.len(), 8);
        assert_eq!(all.metadata.resource_version.as_deref(), Some("11"));

        // Selectors and namespaces.
        let ours = services
            .list(&ListParams::default().labels(NOT_OTHER_PROXY))
            .await?;
        assert!(!names(&ours.items).contains(&"dns".to_string()));
        assert_eq!(ours.items.len(), 7);
        let web = services
            .list(&ListParams::default().labels("app in (web,db),app!=x"))
            .await?;
        assert_eq!(web.items.len(), 5);
        let one = services
            .list(&ListParams::default().fields("metadata.name=svc-1"))
            .await?;
        assert_eq!(names(&one.items), ["svc-1"]);
        let system: Api<Service> = Api::namespaced(client.clone(), "kube-system");
        assert_eq!(
            names(&system.list(&ListParams::default()).await?.items),
            ["dns", "metrics"]
        );
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
        let slice = slices.get("svc-0-abc").await?;
        assert_eq!(slice.endpoints[0].addresses, ["10.180.0.2"]);
        let nodes: Api<Node> = Api::all(client.clone());
        assert_eq!(
            names(&nodes.list(&ListParams::default()).await?.items),
            ["node-a"]
        );

        // Writes over HTTP.
        let default: Api<Service> = Api::namespaced(client.clone(), "default");
        let mut created = default
            .create(
                &PostParams::default(),
                &serde_json::from_value(svc("", "posted", json!({})))?,
            )
            .await?;
        assert_eq!(created.metadata.resource_version.as_deref(), Some("12"));
        assert!(
            default
                .create(&PostParams::default(), &created)
                .await
                .is_err()
        );
        created.labels_mut().insert("x".into(), "y".into());
        let replaced = default
            .replace("posted", &PostParams::default(), &created)
            .await?;
        assert_eq!(replaced.metadata.uid, created.metadata.uid);
        // A stale resourceVersion conflicts.
        let stale = default
            .replace("posted", &PostParams::default(), &created)
            .await;
        assert!(matches!(stale, Err(kube::Error::Api(s)) if s.code == 409));
        default.delete("posted", &DeleteParams::default()).await?;
        let gone = default.get("posted").await;
        assert!(matches!(gone, Err(kube::Error::Api(s)) if s.code == 404));
        assert!(api.get("Service", "default", "posted").is_none());

        // ServiceCIDRs, and a cluster that does not serve them.
        let cidrs: Api<ServiceCIDR> = Api::all(client.clone());
        assert_eq!(
            names(&cidrs.list(&ListParams::default()).await?.items),
            ["kubernetes"]
        );
        api.set_serve_servicecidrs(false);
        let missing = cidrs.list(&ListParams::default()).await;
        assert!(matches!(missing, Err(kube::Error::Api(s)) if s.code == 404));

        // An exact list from before the compaction point is gone.
        api.compact();
        let exact = ListParams::default().at("5").matching(VersionMatch::Exact);
        let old = services.list(&exact).await;
        assert!(matches!(old, Err(kube::Error::Api(s)) if s.code == 410));
        Ok(())
    });

    let log: Vec<String> = api
        .requests()
        .iter()
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect();
    for want in [
        "GET /api/v1/services?&limit=2",
        "GET /api/v1/namespaces/kube-system/services?",
        "POST /api/v1/namespaces/default/services?",
        "DELETE /api/v1/namespaces/default/services/posted?",
    ] {
        assert!(log.iter().any(|l| l == want), "{want} not in {log:#?}");
    }
    assert!(api.requests().iter().all(|r| r.status.is_some()));
}

/// Retries after 100 ms, always (the default backoff starts at 800 ms and grows).
struct Quick;

impl Iterator for Quick {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(Duration::from_millis(100))
    }
}

impl Backoff for Quick {
    fn reset(&mut self) {}
}

type Events = std::pin::Pin<Box<dyn Stream<Item = Result<Event<Service>, watcher::Error>>>>;

fn describe(e: Result<Event<Service>, watcher::Error>) -> String {
    match e {
        Ok(Event::Init) => "Init".into(),
        Ok(Event::InitApply(s)) => format!("InitApply({})", s.name_any()),
        Ok(Event::InitDone) => "InitDone".into(),
        Ok(Event::Apply(s)) => format!("Apply({})", s.name_any()),
        Ok(Event::Delete(s)) => format!("Delete({})", s.name_any()),
        Err(e) => format!("Err({e})"),
    }
}

/// The next events, errors skipped unless `errors`, until `n` were collected.
async fn take(events: &mut Events, n: usize, errors: bool) -> Vec<String> {
    let mut got = Vec::new();
    while got.len() < n {
        let e = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .unwrap_or_else(|_| panic!("no watcher event in 5 s after {got:?}"))
            .expect("watcher streams never end");
        let d = describe(e);
        if errors || !d.starts_with("Err(") {
            got.push(d);
        }
    }
    got
}

/// Skips events until one that satisfies `want` (returning it).
async fn until(events: &mut Events, want: impl Fn(&str) -> bool) -> String {
    let mut skipped = Vec::new();
    loop {
        let d = take(events, 1, true).await.remove(0);
        if want(&d) {
            return d;
        }
        skipped.push(d);
        assert!(skipped.len() < 50, "never got the event, only {skipped:?}");
    }
}

#[test]
fn watcher_follows_changes_and_survives_faults() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &env.api;
    api.set_bookmark_interval(Duration::from_millis(200));
    api.apply(svc("default", "a", json!({}))).unwrap();
    api.apply(svc("default", "b", json!({}))).unwrap();

    // A read timeout lets the client notice a stalled server (kube's default is none).
    client_side(&env, Some(Duration::from_secs(1)), |client| async move {
        let services: Api<Service> = Api::all(client);
        let config = watcher::Config::default().labels(NOT_OTHER_PROXY);
        let mut events: Events = watcher(services, config).backoff(Quick).boxed_local();
        assert_eq!(
            take(&mut events, 4, true).await,
            ["Init", "InitApply(a)", "InitApply(b)", "InitDone"]
        );

        // Changes, with label-selector transitions.
        api.apply(svc("default", "c", json!({})))?;
        api.apply(svc("default", "a", json!({"v": "2"})))?;
        api.delete("Service", "default", "b")?;
        api.apply(svc("default", "d", json!({PROXY_NAME: "other"})))?;
        api.apply(svc("default", "c", json!({PROXY_NAME: "other"})))?;
        api.apply(svc("default", "d", json!({})))?;
        assert_eq!(
            take(&mut events, 5, true).await,
            ["Apply(c)", "Apply(a)", "Delete(b)", "Delete(c)", "Apply(d)"]
        );

        // Missed changes behind a compaction: 410, then a re-list without the deleted object.
        api.set_stall(true);
        api.delete("Service", "default", "a")?;
        api.apply(svc("default", "e", json!({})))?;
        api.compact();
        api.drop_connections();
        api.set_stall(false);
        let err = until(&mut events, |e| e.starts_with("Err(")).await;
        assert!(err.contains("too old resource version"), "{err}");
        assert_eq!(
            take(&mut events, 4, true).await,
            ["Init", "InitApply(d)", "InitApply(e)", "InitDone"]
        );

        // Refused connections: errors, then the watch resumes where it was.
        api.set_refuse(true);
        api.apply(svc("default", "f", json!({})))?;
        until(&mut events, |e| e.starts_with("Err(")).await;
        api.set_refuse(false);
        assert_eq!(
            until(&mut events, |e| !e.starts_with("Err(")).await,
            "Apply(f)"
        );

        // A stalled server: the read timeout fires, then it recovers.
        api.set_stall(true);
        api.apply(svc("default", "g", json!({})))?;
        until(&mut events, |e| e.starts_with("Err(")).await;
        api.set_stall(false);
        assert_eq!(
            until(&mut events, |e| !e.starts_with("Err(")).await,
            "Apply(g)"
        );

        // A restart keeps objects and resourceVersions: the watch just resumes.
        api.restart();
        api.apply(svc("default", "h", json!({})))?;
        assert_eq!(
            until(&mut events, |e| !e.starts_with("Err(")).await,
            "Apply(h)"
        );
        Ok(())
    });

    let reqs = api.requests();
    let lists: Vec<&str> = reqs
        .iter()
        .filter(|r| !r.is_watch())
        .map(|r| r.uri.as_str())
        .collect();
    let selector = "labelSelector=%21service.kubernetes.io%2Fservice-proxy-name";
    assert_eq!(
        lists,
        vec![format!("/api/v1/services?&{selector}&limit=500"); 2]
    );
    let watch = reqs.iter().find(|r| r.is_watch()).unwrap();
    assert_eq!(
        watch.uri,
        format!(
            "/api/v1/services?&watch=true&timeoutSeconds=290&{selector}&allowWatchBookmarks=true&resourceVersion=2"
        )
    );
}

#[test]
fn bookmarks_streaming_lists_and_expired_watches() {
    nftproxy_tests::require_root!();
    let env = env();
    let api = &env.api;
    api.set_bookmark_interval(Duration::from_millis(200));
    api.apply(svc("default", "a", json!({}))).unwrap();

    client_side(&env, None, |client| async move {
        let services: Api<Service> = Api::all(client.clone());
        // From "0": ADDED for what exists, bookmarks, the end after timeoutSeconds.
        let start = std::time::Instant::now();
        let stream = services
            .watch(&WatchParams::default().timeout(1), "0")
            .await?;
        let events: Vec<_> = stream.collect().await;
        assert!(start.elapsed() >= Duration::from_secs(1));
        let mut bookmarks = 0;
        for (i, e) in events.into_iter().enumerate() {
            match e? {
                WatchEvent::Added(s) if i == 0 => assert_eq!(s.name_any(), "a"),
                WatchEvent::Bookmark(b) => {
                    assert_eq!(b.metadata.resource_version, "1");
                    assert_eq!(b.types.kind, "Service");
                    bookmarks += 1;
                }
                e => panic!("unexpected {e:?}"),
            }
        }
        assert!(bookmarks >= 3, "{bookmarks} bookmarks");

        // From a compacted resourceVersion: one 410 ERROR event, then the end.
        api.apply(svc("default", "b", json!({})))?;
        api.compact();
        let stream = services.watch(&WatchParams::default(), "1").await?;
        let events: Vec<_> = stream.collect().await;
        assert_eq!(events.len(), 1);
        match &events[0] {
            Ok(WatchEvent::Error(s)) => {
                assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
                assert_eq!(s.message, "too old resource version: 1 (2)");
            }
            e => panic!("unexpected {e:?}"),
        }

        // The WatchList initial strategy (sendInitialEvents + initial-events-end bookmark).
        let config = watcher::Config::default().streaming_lists();
        let mut events: Events = watcher(services, config).boxed_local();
        assert_eq!(
            take(&mut events, 4, true).await,
            ["Init", "InitApply(a)", "InitApply(b)", "InitDone"]
        );
        api.delete("Service", "default", "a")?;
        assert_eq!(take(&mut events, 1, true).await, ["Delete(a)"]);
        Ok(())
    });
}
