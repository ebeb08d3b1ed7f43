//! The metrics server on `metricsBindAddress`: `/metrics` (Prometheus text format 0.0.4), plus
//! kube-proxy's `/proxyMode` and `/healthz` ("ok") on the same port.

use std::sync::Arc;

use hyper::{Request, StatusCode};

use super::{Handler, not_found, response};

pub fn handler(proxy_mode: &'static str) -> Handler {
    Arc::new(move |req: &Request<hyper::body::Incoming>| {
        let text = |body: String| {
            response(
                StatusCode::OK,
                &[
                    ("Content-Type", "text/plain; charset=utf-8".into()),
                    ("X-Content-Type-Options", "nosniff".into()),
                ],
                body,
            )
        };
        match req.uri().path() {
            "/metrics" => response(
                StatusCode::OK,
                &[("Content-Type", metrics::CONTENT_TYPE.into())],
                metrics::encode(),
            ),
            "/proxyMode" => text(proxy_mode.to_string()),
            "/healthz" => text("ok".to_string()),
            _ => not_found(),
        }
    })
}
