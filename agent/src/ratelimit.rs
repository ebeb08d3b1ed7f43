//! kube-proxy's `clientConnection.qps` and `burst`: client-go's token bucket on the API client,
//! so that a node agent on thousands of nodes asks the API server no more often than kube-proxy
//! would. The bucket holds `burst` tokens and refills at `qps` per second; a request waits for a
//! token.
//!
//! The further pages of one list (requests with `continue=`) take no token: the limit is about
//! how often a client starts a list or a watch, not how the answer is paged (kube-proxy's
//! informers list from the watch cache, historically in one answer; nftproxy asks the watch
//! cache too, 500 objects a page).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use hyper::Request;

/// A token bucket (client-go's `flowcontrol.NewTokenBucketRateLimiter`).
#[derive(Clone, Debug)]
pub struct Bucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Full at `now`. `qps <= 0` means no limit.
    pub fn new(qps: f32, burst: u32, now: Instant) -> Bucket {
        let burst = f64::from(burst.max(1));
        Bucket {
            qps: f64::from(qps),
            burst,
            tokens: burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        self.at = now;
    }

    /// How long until a token is there (zero: now).
    pub fn wait(&mut self, now: Instant) -> Duration {
        if self.qps <= 0.0 {
            return Duration::ZERO;
        }
        self.refill(now);
        if self.tokens >= 1.0 {
            Duration::ZERO
        } else {
            // A tiny `qps` (`1e-30`) waits "forever" rather than overflowing `Duration`.
            Duration::try_from_secs_f64((1.0 - self.tokens) / self.qps).unwrap_or(Duration::MAX)
        }
    }

    /// Takes a token (after [`Bucket::wait`] said one is there).
    pub fn take(&mut self, now: Instant) {
        if self.qps > 0.0 {
            self.refill(now);
            self.tokens -= 1.0;
        }
    }
}

/// The runtime's clock (tokio's, so that it agrees with the sleeps).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Whether `req` fetches a further page of a list already started.
fn continues_a_list<B>(req: &Request<B>) -> bool {
    req.uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv.starts_with("continue=")))
}

/// Rate-limits the requests of the wrapped service.
#[derive(Clone, Copy, Debug)]
pub struct RateLimitLayer {
    qps: f32,
    burst: u32,
}

impl RateLimitLayer {
    pub fn new(qps: f32, burst: u32) -> RateLimitLayer {
        RateLimitLayer { qps, burst }
    }
}

impl<S> tower::Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            bucket: Bucket::new(self.qps, self.burst, Instant::now()),
            sleep: None,
        }
    }
}

/// The service [`RateLimitLayer`] makes: ready only when a token is there.
pub struct RateLimit<S> {
    inner: S,
    bucket: Bucket,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S, B> tower::Service<Request<B>> for RateLimit<S>
where
    S: tower::Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        loop {
            if let Some(sleep) = &mut self.sleep {
                ready!(sleep.as_mut().poll(cx));
                self.sleep = None;
            }
            let wait = self.bucket.wait(now());
            if wait.is_zero() {
                break;
            }
            self.sleep = Some(Box::pin(tokio::time::sleep(wait)));
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> S::Future {
        if !continues_a_list(&req) {
            self.bucket.take(now());
        }
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_qps() {
        let t0 = Instant::now();
        let mut b = Bucket::new(5.0, 10, t0);
        for _ in 0..10 {
            assert_eq!(b.wait(t0), Duration::ZERO);
            b.take(t0);
        }
        let wait = b.wait(t0);
        assert!((wait.as_secs_f64() - 0.2).abs() < 1e-9, "{wait:?}");
        let later = t0 + wait;
        assert_eq!(b.wait(later), Duration::ZERO);
        b.take(later);
        // A long idle time refills up to the burst, not beyond.
        let idle = later + Duration::from_secs(60);
        for _ in 0..10 {
            assert_eq!(b.wait(idle), Duration::ZERO);
            b.take(idle);
        }
        assert!(b.wait(idle) > Duration::ZERO);
    }

    #[test]
    fn no_qps_means_no_limit() {
        let t0 = Instant::now();
        let mut b = Bucket::new(0.0, 1, t0);
        for _ in 0..100 {
            assert_eq!(b.wait(t0), Duration::ZERO);
            b.take(t0);
        }
    }

    #[test]
    fn only_further_pages_are_free() {
        let req = |uri: &str| Request::builder().uri(uri).body(()).unwrap();
        assert!(continues_a_list(&req(
            "/api/v1/services?limit=500&continue=abc"
        )));
        assert!(!continues_a_list(&req("/api/v1/services?limit=500")));
        assert!(!continues_a_list(&req(
            "/api/v1/services?watch=true&resourceVersion=5"
        )));
    }

    #[tokio::test]
    async fn requests_wait_for_a_token() {
        use tower::{Layer, Service, ServiceExt};
        let inner =
            tower::service_fn(|_: Request<()>| async { Ok::<_, std::convert::Infallible>(()) });
        let mut svc = RateLimitLayer::new(20.0, 2).layer(inner);
        let start = Instant::now();
        for i in 0..4 {
            let uri = format!("/api/v1/nodes?i={i}");
            svc.ready().await.unwrap();
            svc.call(Request::builder().uri(uri).body(()).unwrap())
                .await
                .unwrap();
        }
        // Two at once (the burst), then one every 50 ms.
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(95), "{took:?}");
        // Further pages take no token.
        let before = Instant::now();
        for _ in 0..20 {
            svc.ready().await.unwrap();
            let page = Request::builder()
                .uri("/api/v1/nodes?continue=x")
                .body(())
                .unwrap();
            svc.call(page).await.unwrap();
        }
        assert!(
            before.elapsed() < Duration::from_millis(200),
            "{:?}",
            before.elapsed()
        );
    }
}
