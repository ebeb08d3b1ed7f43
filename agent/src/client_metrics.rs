//! client-go's request metrics for the agent's Kubernetes client, as a [`tower::Layer`] on
//! kube's client stack, so kube-prometheus's kube-proxy dashboard ("Kube API Request Rate",
//! "Post/Get Request Latency") has its series:
//!
//! - `rest_client_requests_total{code,host,method}`: every request once, with its final status
//!   (`"200"`), or `"<error>"` when it failed, or was given up, without a response. It is
//!   counted when the response head arrives, so a watch is counted when it starts, not hours
//!   later when its stream ends.
//! - `rest_client_request_duration_seconds{host,verb}`: the time from the call to the end of
//!   the response body, for every request but streams (watches, logs, exec/attach), which
//!   client-go does not observe either (its `Watch` and `Stream` paths record no latency).
//!
//! `host` is the API server's `host:port` as written in the client's URL (Go's `url.Host`);
//! `method` and `verb` are the HTTP method. Retries inside kube's stack (below this layer) make
//! one request, as client-go counts only a request's final answer.
//!
//! ```ignore
//! let layer = ClientMetricsLayer::new(&config.cluster_url);
//! let client = kube::client::ClientBuilder::try_from(config)?.with_layer(&layer).build();
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use hyper::body::{Body, Frame, SizeHint};
use hyper::{Request, Response, Uri, header};
use metrics::{Metrics, REST_CLIENT_ERROR_CODE};

/// kube's names (request extension) of operations whose response is a stream.
const STREAMING_OPERATIONS: &[&str] = &[
    "watch",
    "watch_metadata",
    "log_stream",
    "exec",
    "attach",
    "kubelet_node_exec",
    "kubelet_node_attach",
    "kubelet_node_log",
    "kubelet_node_portforward",
];

/// Go's `url.URL.Host` of `uri`: `host[:port]` as written (IPv6 in brackets, no default port
/// added, no user info); `"none"` without an authority, as client-go labels a client without
/// a base URL.
pub fn host_label(uri: &Uri) -> String {
    match uri.authority() {
        Some(a) => match a.port() {
            Some(port) => format!("{}:{}", a.host(), port.as_str()),
            None => a.host().to_string(),
        },
        None => "none".to_string(),
    }
}

/// Whether the response to `req` is a stream (a watch, logs followed, an upgraded connection).
fn is_stream<B>(req: &Request<B>) -> bool {
    let watch_param = req
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let operation = req
        .extensions()
        .get::<&'static str>()
        .is_some_and(|op| STREAMING_OPERATIONS.contains(op));
    watch_param || operation || req.headers().contains_key(header::UPGRADE)
}

/// Records client-go's request metrics for every request through the wrapped service.
#[derive(Clone, Debug)]
pub struct ClientMetricsLayer {
    host: Arc<str>,
    metrics: &'static Metrics,
}

impl ClientMetricsLayer {
    /// For a client of the API server at `cluster_url` (kube's `Config::cluster_url`),
    /// recording into the process-wide metrics.
    pub fn new(cluster_url: &Uri) -> ClientMetricsLayer {
        ClientMetricsLayer::with_metrics(cluster_url, metrics::metrics())
    }

    /// Same, recording into `metrics`.
    pub fn with_metrics(cluster_url: &Uri, metrics: &'static Metrics) -> ClientMetricsLayer {
        ClientMetricsLayer {
            host: host_label(cluster_url).into(),
            metrics,
        }
    }
}

impl<S> tower::Layer<S> for ClientMetricsLayer {
    type Service = ClientMetrics<S>;

    fn layer(&self, inner: S) -> ClientMetrics<S> {
        ClientMetrics {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`ClientMetricsLayer`] makes.
#[derive(Clone, Debug)]
pub struct ClientMetrics<S> {
    inner: S,
    layer: ClientMetricsLayer,
}

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for ClientMetrics<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<TimedBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let mut pending = Pending {
            metrics: self.layer.metrics,
            host: self.layer.host.clone(),
            method: req.method().as_str().to_string(),
            start: Instant::now(),
            stream: is_stream(&req),
            answered: false,
        };
        let answer = self.inner.call(req);
        Box::pin(async move {
            let result = answer.await;
            let code = match &result {
                Ok(resp) => resp.status().as_str().to_string(),
                Err(_) => REST_CLIENT_ERROR_CODE.to_string(),
            };
            pending.answered = true;
            let m = pending.metrics;
            m.rest_client_request(&code, &pending.method, &pending.host);
            let timer = (!pending.stream).then(|| pending.timer());
            match result {
                Ok(resp) => Ok(resp.map(|inner| TimedBody { inner, timer })),
                // Dropping the timer observes the duration now.
                Err(e) => Err(e),
            }
        })
    }
}

/// A request on its way: counts it as `"<error>"` if its future is dropped before an answer
/// (the caller gave up, as a cancelled Go context makes `client.Do` fail).
struct Pending {
    metrics: &'static Metrics,
    host: Arc<str>,
    method: String,
    start: Instant,
    stream: bool,
    answered: bool,
}

impl Pending {
    fn timer(&self) -> Timer {
        Timer {
            metrics: self.metrics,
            host: self.host.clone(),
            verb: self.method.clone(),
            start: self.start,
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        self.metrics
            .rest_client_request(REST_CLIENT_ERROR_CODE, &self.method, &self.host);
        if !self.stream {
            drop(self.timer());
        }
    }
}

/// Observes a request's duration when dropped: at the end of its response body, or when the
/// body is dropped unread, or at once for a request that failed.
struct Timer {
    metrics: &'static Metrics,
    host: Arc<str>,
    verb: String,
    start: Instant,
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.metrics
            .observe_rest_client_duration(&self.verb, &self.host, self.start.elapsed());
    }
}

/// A response body that completes its request's duration when it ends (streams: no timer).
pub struct TimedBody<B> {
    inner: B,
    timer: Option<Timer>,
}

impl<B> std::fmt::Debug for TimedBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimedBody")
            .field("timed", &self.timer.is_some())
            .finish_non_exhaustive()
    }
}

impl<B: Body + Unpin> Body for TimedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            this.timer.take();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper::StatusCode;
    use tower::{Layer, Service};

    use super::*;

    type Answer = Result<Response<Full<Bytes>>, std::io::Error>;

    /// The API server: answers every request with `answer`, or never.
    #[derive(Clone)]
    struct Stub {
        answer: Option<fn() -> Answer>,
    }

    impl Service<Request<()>> for Stub {
        type Response = Response<Full<Bytes>>;
        type Error = std::io::Error;
        type Future = Pin<Box<dyn Future<Output = Answer> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<()>) -> Self::Future {
            match self.answer {
                Some(answer) => Box::pin(async move { answer() }),
                None => Box::pin(std::future::pending()),
            }
        }
    }

    fn ok() -> Answer {
        Ok(Response::new(Full::new(Bytes::from_static(b"{}"))))
    }

    fn forbidden() -> Answer {
        let mut r = Response::new(Full::new(Bytes::from_static(b"{}")));
        *r.status_mut() = StatusCode::FORBIDDEN;
        Ok(r)
    }

    fn refused() -> Answer {
        Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
    }

    fn get(uri: &str) -> Request<()> {
        Request::get(uri).body(()).unwrap()
    }

    fn service(answer: Option<fn() -> Answer>) -> (ClientMetrics<Stub>, &'static Metrics) {
        let metrics: &'static Metrics = Box::leak(Box::new(Metrics::new()));
        let url: Uri = "https://192.168.0.10:6443".parse().unwrap();
        let layer = ClientMetricsLayer::with_metrics(&url, metrics);
        (layer.layer(Stub { answer }), metrics)
    }

    async fn send(
        svc: &mut ClientMetrics<Stub>,
        req: Request<()>,
    ) -> Result<Response<TimedBody<Full<Bytes>>>, std::io::Error> {
        poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
        svc.call(req).await
    }

    const HOST: &str = "192.168.0.10:6443";

    /// The value of `series` in the exposition ("0" if absent).
    fn value(m: &Metrics, series: &str) -> String {
        m.encode()
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')
                    .map(str::to_string)
            })
            .unwrap_or_else(|| "0".to_string())
    }

    fn requests(m: &Metrics, code: &str, method: &str) -> String {
        let labels = format!("code=\"{code}\",host=\"{HOST}\",method=\"{method}\"");
        value(m, &format!("rest_client_requests_total{{{labels}}}"))
    }

    fn durations(m: &Metrics, verb: &str) -> String {
        let labels = format!("host=\"{HOST}\",verb=\"{verb}\"");
        value(
            m,
            &format!("rest_client_request_duration_seconds_count{{{labels}}}"),
        )
    }

    #[tokio::test]
    async fn a_request_is_counted_with_its_status_and_timed_to_its_body_end() {
        let (mut svc, m) = service(Some(ok));
        let resp = send(&mut svc, get("/api/v1/services?limit=500"))
            .await
            .unwrap();
        assert_eq!(requests(m, "200", "GET"), "1");
        // The duration is observed when the body has been read, not at the head.
        assert_eq!(durations(m, "GET"), "0");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{}");
        assert_eq!(durations(m, "GET"), "1");

        let (mut svc, m) = service(Some(forbidden));
        let mut req = Request::post("/api/v1/namespaces/ns/events")
            .body(())
            .unwrap();
        req.extensions_mut().insert("create");
        drop(send(&mut svc, req).await.unwrap());
        assert_eq!(requests(m, "403", "POST"), "1");
        // A body dropped unread ends the request too.
        assert_eq!(durations(m, "POST"), "1");
    }

    #[tokio::test]
    async fn a_watch_is_counted_when_its_stream_starts_and_not_timed() {
        let (mut svc, m) = service(Some(ok));
        let resp = send(
            &mut svc,
            get("/api/v1/services?allowWatchBookmarks=true&resourceVersion=5&watch=true"),
        )
        .await
        .unwrap();
        // Counted while the stream is still open.
        assert_eq!(requests(m, "200", "GET"), "1");
        drop(resp);
        assert_eq!(durations(m, "GET"), "0");

        let mut req = get("/api/v1/namespaces/ns/pods/p/log?follow=true");
        req.extensions_mut().insert("log_stream");
        drop(send(&mut svc, req).await.unwrap());
        assert_eq!(requests(m, "200", "GET"), "2");
        assert_eq!(durations(m, "GET"), "0");
    }

    #[tokio::test]
    async fn a_request_without_a_response_is_an_error() {
        let (mut svc, m) = service(Some(refused));
        assert!(send(&mut svc, get("/api/v1/nodes")).await.is_err());
        assert_eq!(requests(m, "<error>", "GET"), "1");
        assert_eq!(durations(m, "GET"), "1");

        // The caller gives up (a timeout drops the future) before any answer.
        let (mut svc, m) = service(None);
        poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
        let call = svc.call(get("/api/v1/nodes"));
        let gave_up = tokio::time::timeout(std::time::Duration::from_millis(10), call).await;
        assert!(gave_up.is_err());
        assert_eq!(requests(m, "<error>", "GET"), "1");
        assert!(!m.encode().contains("code=\"200\""));
    }

    #[test]
    fn hosts_are_labelled_like_gos_url_host() {
        let host = |s: &str| host_label(&s.parse().unwrap());
        assert_eq!(host("https://192.168.0.10:6443"), "192.168.0.10:6443");
        assert_eq!(host("https://192.168.0.10:6443/"), "192.168.0.10:6443");
        assert_eq!(host("https://[fd00::10]:6443"), "[fd00::10]:6443");
        assert_eq!(host("https://api.example.com"), "api.example.com");
        assert_eq!(
            host("https://user:secret@api.example.com:443"),
            "api.example.com:443"
        );
        assert_eq!(host("/api/v1/nodes"), "none");
    }
}
