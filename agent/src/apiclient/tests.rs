use super::*;
use std::collections::HashMap;

fn target(url: &str, origin: Origin) -> Target {
    Target {
        config: kube::Config::new(url.parse().unwrap()),
        origin,
    }
}

fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn the_kubelets_variables_name_the_cluster_ip() {
    let ip: IpAddr = "10.96.0.1".parse().unwrap();
    assert_eq!(
        kubernetes_service_ip(env(&[("KUBERNETES_PORT", "tcp://10.96.0.1:443")])),
        Some(ip)
    );
    assert_eq!(
        kubernetes_service_ip(env(&[("KUBERNETES_PORT_443_TCP_ADDR", "10.96.0.1")])),
        Some(ip)
    );
    assert_eq!(
        kubernetes_service_ip(env(&[("KUBERNETES_PORT", "tcp://[fd00::1]:443")])),
        Some("fd00::1".parse().unwrap())
    );
    assert_eq!(kubernetes_service_ip(env(&[])), None);
    assert_eq!(
        kubernetes_service_ip(env(&[("KUBERNETES_PORT", "nonsense")])),
        None
    );
}

#[test]
fn a_cluster_ip_server_is_named_with_the_fix() {
    let cluster = Cluster::default();
    let kube_ip = Some("10.96.0.1".parse().unwrap());
    let msg = cluster_ip_problem(
        &target("https://10.96.0.1:443", Origin::Kubeconfig("k".into())),
        kube_ip,
        &cluster,
    )
    .expect("the kubernetes ClusterIP");
    assert!(
        msg.contains("https://10.96.0.1") && msg.contains("default/kubernetes"),
        "{msg}"
    );
    assert!(
        msg.contains("KUBERNETES_SERVICE_HOST") && msg.contains("--master"),
        "{msg}"
    );
    // In-cluster configuration always uses the ClusterIP.
    assert!(
        cluster_ip_problem(
            &target("https://10.0.0.1:443", Origin::InCluster),
            None,
            &cluster
        )
        .is_some()
    );
    // The control plane's own address is fine.
    assert!(
        cluster_ip_problem(
            &target("https://192.0.2.10:6443", Origin::Master),
            kube_ip,
            &cluster
        )
        .is_none()
    );
    assert!(
        cluster_ip_problem(
            &target("https://api.example:6443", Origin::Master),
            kube_ip,
            &cluster
        )
        .is_none()
    );
}

#[test]
fn known_service_cidrs_and_cluster_ips_count() {
    let mut cluster = Cluster::default();
    cluster
        .service_cidrs
        .insert("kubernetes".into(), vec!["10.100.0.0/16".parse().unwrap()]);
    let msg = cluster_ip_problem(
        &target("https://10.100.3.4", Origin::Master),
        None,
        &cluster,
    )
    .unwrap();
    assert!(msg.contains("ServiceCIDR 10.100.0.0/16"), "{msg}");
    assert!(
        cluster_ip_problem(
            &target("https://[fd00::1]:6443", Origin::Master),
            None,
            &cluster
        )
        .is_none()
    );
}

mod stack {
    use std::convert::Infallible;

    use futures::StreamExt;
    use futures::channel::mpsc;
    use http_body_util::{BodyExt, StreamBody};
    use tower::Service;

    use super::super::*;

    fn get(uri: &str) -> HttpRequest<()> {
        HttpRequest::get(uri).body(()).unwrap()
    }

    fn uri_after(uri: &str) -> String {
        let mut req = get(uri);
        list_from_watch_cache(&mut req);
        req.uri().to_string()
    }

    #[test]
    fn first_pages_of_lists_come_from_the_watch_cache() {
        assert_eq!(
            uri_after("/api/v1/services?&labelSelector=a&limit=500"),
            "/api/v1/services?&labelSelector=a&limit=500&resourceVersion=0"
        );
        for unchanged in [
            "/api/v1/services?&limit=500&continue=abc",
            "/api/v1/services?&limit=500&resourceVersion=7&resourceVersionMatch=Exact",
            "/api/v1/services?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true&resourceVersion=7",
            "/api/v1/services?&resourceVersion=0&resourceVersionMatch=NotOlderThan",
            "/api/v1/namespaces/a/services/b",
        ] {
            assert_eq!(uri_after(unchanged), unchanged);
        }
    }

    #[test]
    fn retry_after_and_bookmarks_are_read() {
        assert_eq!(parse_retry_after(" 7 "), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
        assert!(is_bookmark(
            br#"{"type":"BOOKMARK","object":{"kind":"Service","metadata":{"resourceVersion":"12"}}}"#
        ));
        assert!(is_bookmark(
            br#"{"object":{"metadata":{}},"type":"BOOKMARK"}"#
        ));
        assert!(!is_bookmark(
            br#"{"type":"ADDED","object":{"metadata":{}}}"#
        ));
    }

    type Chunks = mpsc::UnboundedSender<Bytes>;
    type Streamed = StreamBody<
        futures::stream::Map<
            mpsc::UnboundedReceiver<Bytes>,
            fn(Bytes) -> Result<Frame<Bytes>, Infallible>,
        >,
    >;

    fn streamed() -> (Chunks, Streamed) {
        let (tx, rx) = mpsc::unbounded();
        let frames: fn(Bytes) -> Result<Frame<Bytes>, Infallible> = |b| Ok(Frame::data(b));
        (tx, StreamBody::new(rx.map(frames)))
    }

    /// An API server that answers with `status`, `headers` and a body, or never.
    #[derive(Clone)]
    struct Stub(Arc<Mutex<Option<Response<Streamed>>>>);

    impl Stub {
        fn answering(resp: Response<Streamed>) -> Stub {
            Stub(Arc::new(Mutex::new(Some(resp))))
        }
    }

    impl Service<HttpRequest<()>> for Stub {
        type Response = Response<Streamed>;
        type Error = Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Response<Streamed>, Infallible>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: HttpRequest<()>) -> Self::Future {
            match lock(&self.0).take() {
                Some(resp) => Box::pin(async move { Ok(resp) }),
                None => Box::pin(std::future::pending()),
            }
        }
    }

    fn guard(stub: Stub, liveness: &Arc<Liveness>) -> Guard<Stub> {
        Guard::new(stub, liveness.clone())
            .with_timeouts(Duration::from_millis(100), Duration::from_millis(100))
    }

    #[tokio::test]
    async fn an_answer_that_never_starts_times_out() {
        let liveness = Arc::new(Liveness::default());
        let mut svc = guard(Stub(Arc::default()), &liveness);
        let err = svc
            .call(get("/api/v1/services?&limit=500"))
            .await
            .err()
            .unwrap();
        assert_eq!(
            err.downcast_ref::<Timeout>(),
            Some(&Timeout::Response(Duration::from_millis(100)))
        );
    }

    #[tokio::test]
    async fn a_stalled_list_body_times_out() {
        let liveness = Arc::new(Liveness::default());
        let (tx, body) = streamed();
        let mut svc = guard(Stub::answering(Response::new(body)), &liveness);
        let mut answered = liveness.answered("/api/v1/services");
        let resp = svc.call(get("/api/v1/services?&limit=500")).await.unwrap();
        assert!(answered.has_changed().unwrap());
        answered.mark_unchanged();
        tx.unbounded_send(Bytes::from_static(b"{\"items\":["))
            .unwrap();
        let err = resp.into_body().collect().await.err().unwrap();
        assert_eq!(
            err.downcast_ref::<Timeout>(),
            Some(&Timeout::Body(Duration::from_millis(100)))
        );
    }

    #[tokio::test]
    async fn overload_answers_hand_their_retry_after_to_the_watcher() {
        let liveness = Arc::new(Liveness::default());
        let (_tx, body) = streamed();
        let mut resp = Response::new(body);
        *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        resp.headers_mut()
            .insert(hyper::header::RETRY_AFTER, "3".parse().unwrap());
        let mut svc = guard(Stub::answering(resp), &liveness);
        let answered = liveness.answered("/api/v1/nodes");
        svc.call(get("/api/v1/nodes?&limit=500")).await.unwrap();
        assert!(!answered.has_changed().unwrap());
        let after = liveness.retry_after("/api/v1/nodes").unwrap();
        assert!(after > Duration::from_secs(2) && after <= Duration::from_secs(3));
        assert_eq!(liveness.retry_after("/api/v1/nodes"), None, "counted once");
        assert_eq!(liveness.retry_after("/api/v1/services"), None);
    }

    #[tokio::test]
    async fn without_bookmarks_a_quiet_watch_is_left_alone() {
        let (min, max) = (Duration::from_millis(50), Duration::from_millis(100));
        let liveness = Arc::new(Liveness::with_watch_bounds(min, max));
        let (tx, body) = streamed();
        let mut svc = guard(Stub::answering(Response::new(body)), &liveness);
        let resp = svc
            .call(get("/api/v1/nodes?&watch=true&resourceVersion=5"))
            .await
            .unwrap();
        let mut body = resp.into_body();
        tx.unbounded_send(Bytes::from_static(b"{\"type\":\"ADDED\"}\n"))
            .unwrap();
        body.frame().await.unwrap().unwrap();
        let quiet = tokio::time::timeout(Duration::from_millis(400), body.frame()).await;
        assert!(quiet.is_err(), "ended without a known cadence: {quiet:?}");
    }

    #[tokio::test]
    async fn a_silent_watch_is_ended_after_a_few_bookmark_intervals() {
        let (min, max) = (Duration::from_millis(150), Duration::from_secs(2));
        let liveness = Arc::new(Liveness::with_watch_bounds(min, max));
        let path = "/api/v1/services";
        assert_eq!(liveness.watch_bound(path), None, "unknown cadence");
        let (tx, body) = streamed();
        let mut svc = guard(Stub::answering(Response::new(body)), &liveness);
        let resp = svc
            .call(get("/api/v1/services?&watch=true&resourceVersion=5"))
            .await
            .unwrap();
        let mut body = resp.into_body();
        // Events and bookmarks every 100 ms, split across chunks.
        let bookmark = r#"{"object":{"metadata":{"resourceVersion":"9"}},"type":"BOOKMARK"}"#;
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (a, b) = bookmark.split_at(20);
            tx.unbounded_send(Bytes::from(format!("{{\"type\":\"ADDED\"}}\n{a}")))
                .unwrap();
            tx.unbounded_send(Bytes::from(format!("{b}\n"))).unwrap();
            body.frame().await.unwrap().unwrap();
            body.frame().await.unwrap().unwrap();
        }
        let bound = liveness.watch_bound(path).unwrap();
        assert!(
            bound >= Duration::from_millis(300) && bound < Duration::from_millis(600),
            "three bookmark intervals: {bound:?}"
        );
        // A long quiet spell, then silence: the watch ends with an error.
        let start = Instant::now();
        let err = body.frame().await.unwrap().err().unwrap();
        let waited = start.elapsed();
        assert!(waited >= bound && waited < bound * 3, "{waited:?}");
        assert!(matches!(
            err.downcast_ref::<Timeout>(),
            Some(Timeout::Watch(_))
        ));
        assert!(body.frame().await.is_none(), "ended");
        // The next watch gets twice as long, until bookmarks are seen again.
        assert_eq!(liveness.watch_bound(path), Some((bound * 2).min(max)));
        drop(tx);
    }
}
