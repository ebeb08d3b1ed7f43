//! Pipelined list pages: as soon as a page of a list arrives, the next page is asked for, so that
//! the server prepares page N+1 while the watcher decodes and hands out page N.
//!
//! kube-runtime's watcher asks for the next page only once every object of the current one has
//! been decoded and taken, so without this the server waits for the client and the client for
//! the server, page after page. A server that pages (one without a watch cache, or whose cache
//! pages) then takes about the sum of both per page instead of the larger of the two.
//!
//! Only paged lists (`GET` with `limit=` and no `watch`) are touched. Their answers are read
//! whole here (kube reads them whole anyway) and the `continue` token found in it decides the
//! next request, built as kube builds it: the same query without `continue` and
//! `resourceVersion*`, then `continue=TOKEN`. The prefetched answer is handed out only to a
//! request for exactly that URI and `Accept`; any other request for the path discards it (the
//! watcher restarted or asked for something else), so the layer can make an extra request but
//! never answers one with another's result. At most one prefetched page is held per path.
//!
//! The layer sits above the [`crate::apiclient::Guard`], so prefetched requests get its timeouts,
//! and below the metrics and rate-limit layers, which see the watcher's requests as it makes
//! them (further pages take no rate-limit token).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Body;
use hyper::header::{ACCEPT, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, Uri};
use tokio_util::task::AbortOnDropHandle;
use tower::{BoxError, Service, ServiceExt};

use crate::apiclient::{is_watch, lock, query_has};

/// A response read whole.
type Whole = Response<Bytes>;

/// A paged list's answer, or any other answer as it streams.
pub type PrefetchBody<B> = Either<B, Full<Bytes>>;

/// Adds [`Prefetch`] to a client stack.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefetchLayer;

impl<S> tower::Layer<S> for PrefetchLayer {
    type Service = Prefetch<S>;

    fn layer(&self, inner: S) -> Prefetch<S> {
        Prefetch {
            inner,
            pending: Arc::default(),
        }
    }
}

/// The service [`PrefetchLayer`] makes.
#[derive(Clone)]
pub struct Prefetch<S> {
    inner: S,
    /// The page asked for ahead, per path.
    pending: Arc<Mutex<HashMap<String, Ahead>>>,
}

/// A page asked for before the watcher asks for it.
struct Ahead {
    uri: Uri,
    accept: Option<HeaderValue>,
    /// The request's task, aborted when dropped: a discarded prefetch stops at once.
    answer: AbortOnDropHandle<Result<Whole, BoxError>>,
}

/// Whether `req` asks for one page of a list.
fn is_paged_list<B>(req: &Request<B>) -> bool {
    let uri = req.uri();
    req.method() == Method::GET && query_has(uri, |kv| kv.starts_with("limit=")) && !is_watch(uri)
}

/// The request for the page after the one `uri` asked for, whose answer carried `token`.
fn next_page(uri: &Uri, headers: &HeaderMap, token: &str) -> Option<Request<kube::client::Body>> {
    let mut next = form_urlencoded::Serializer::new(format!("{}?", uri.path()));
    for (k, v) in form_urlencoded::parse(uri.query().unwrap_or("").as_bytes()) {
        if !matches!(&*k, "continue" | "resourceVersion" | "resourceVersionMatch") {
            next.append_pair(&k, &v);
        }
    }
    next.append_pair("continue", token);
    let mut req = Request::get(next.finish())
        .body(kube::client::Body::from(Vec::new()))
        .ok()?;
    *req.headers_mut() = headers.clone();
    Some(req)
}

/// The `continue` token of a list answer, if it has a further page.
fn continue_token(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Head {
        metadata: Option<Meta>,
    }
    #[derive(serde::Deserialize)]
    struct Meta {
        #[serde(rename = "continue")]
        token: Option<String>,
    }
    let head: Head = serde_json::from_slice(body).ok()?;
    head.metadata?.token.filter(|t| !t.is_empty())
}

/// Sends `req` and reads the answer whole.
async fn whole<S, B>(inner: S, req: Request<kube::client::Body>) -> Result<Whole, BoxError>
where
    S: Service<Request<kube::client::Body>, Response = Response<B>>,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let resp = inner.oneshot(req).await.map_err(Into::into)?;
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
    Ok(Response::from_parts(parts, bytes))
}

impl<S, B> Service<Request<kube::client::Body>> for Prefetch<S>
where
    S: Service<Request<kube::client::Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<PrefetchBody<B>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<kube::client::Body>) -> Self::Future {
        if !is_paged_list(&req) {
            let answer = self.inner.call(req);
            return Box::pin(
                async move { Ok(answer.await.map_err(Into::into)?.map(Either::Left)) },
            );
        }
        let path = req.uri().path().to_string();
        let (uri, headers) = (req.uri().clone(), req.headers().clone());
        let ahead = lock(&self.pending).remove(&path);
        let answer: Pin<Box<dyn Future<Output = Result<Whole, BoxError>> + Send>> = match ahead {
            Some(a) if a.uri == uri && a.accept.as_ref() == headers.get(ACCEPT) => {
                Box::pin(async move { a.answer.await? })
            }
            other => {
                if let Some(a) = other {
                    tracing::debug!(prefetched = %a.uri, asked = %uri, "list page asked for ahead was not wanted");
                }
                // The service polled ready makes this request; its clone makes the next one.
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                Box::pin(whole(ready, req))
            }
        };
        let inner = self.inner.clone();
        let pending = self.pending.clone();
        Box::pin(async move {
            let resp = answer.await?;
            let next = resp
                .status()
                .is_success()
                .then(|| continue_token(resp.body()))
                .flatten()
                .and_then(|token| next_page(&uri, &headers, &token));
            if let Some(next) = next {
                let ahead = Ahead {
                    uri: next.uri().clone(),
                    accept: next.headers().get(ACCEPT).cloned(),
                    answer: AbortOnDropHandle::new(tokio::spawn(whole(inner, next))),
                };
                lock(&pending).insert(path, ahead);
            }
            Ok(resp.map(|b| Either::Right(Full::new(b))))
        })
    }
}

#[cfg(test)]
mod tests;
