//! The metrics server on `metricsBindAddress`: `/metrics` (Prometheus text format 0.0.4), plus
//! kube-proxy's `/configz`, `/proxyMode` and `/healthz` ("ok") on the same port.

use std::sync::Arc;

use hyper::{Request, Response, StatusCode};

use super::{Handler, not_found, response};

/// component-base's name for kube-proxy's configuration in `/configz`.
pub const CONFIGZ_KEY: &str = "kubeproxy.config.k8s.io";

/// The metrics server's handler. `configz` is the effective configuration (a
/// `KubeProxyConfiguration` as JSON), served under `/configz` as kube-proxy serves it.
pub fn handler(proxy_mode: &'static str, configz: &serde_json::Value) -> Handler {
    let configz: Arc<str> = configz_body(configz).into();
    Arc::new(move |req: &Request<hyper::body::Incoming>| {
        answer(req.uri().path(), proxy_mode, &configz)
    })
}

/// component-base's `/configz` body: `{"kubeproxy.config.k8s.io": <configuration>}`, written
/// as Go's `json.Marshal` writes it (compact, no trailing newline, `<`, `>`, `&`, U+2028 and
/// U+2029 escaped; object keys are sorted unless serde_json's `preserve_order` is on).
pub fn configz_body(configz: &serde_json::Value) -> String {
    let mut doc = serde_json::Map::new();
    doc.insert(CONFIGZ_KEY.to_string(), configz.clone());
    let text = serde_json::Value::Object(doc).to_string();
    // These characters only occur inside JSON strings, where the escapes mean the same.
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// The answer for a request of `path`.
fn answer(
    path: &str,
    proxy_mode: &'static str,
    configz: &str,
) -> Response<http_body_util::Full<bytes::Bytes>> {
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
    match path {
        "/metrics" => response(
            StatusCode::OK,
            &[("Content-Type", metrics::CONTENT_TYPE.into())],
            metrics::encode(),
        ),
        "/configz" => response(
            StatusCode::OK,
            &[
                ("Content-Type", "application/json".into()),
                ("X-Content-Type-Options", "nosniff".into()),
            ],
            configz.to_string(),
        ),
        "/proxyMode" => text(proxy_mode.to_string()),
        "/healthz" => text("ok".to_string()),
        _ => not_found(),
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use serde_json::json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn body(resp: Response<http_body_util::Full<bytes::Bytes>>) -> String {
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    fn header<'a>(resp: &'a Response<http_body_util::Full<bytes::Bytes>>, name: &str) -> &'a str {
        resp.headers()[name].to_str().unwrap()
    }

    #[test]
    fn configz_body_is_component_bases() {
        let config = json!({
            "kind": "KubeProxyConfiguration",
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "mode": "nftables",
            "hostnameOverride": "a<b>&c",
        });
        assert_eq!(
            configz_body(&config),
            "{\"kubeproxy.config.k8s.io\":{\"apiVersion\":\"kubeproxy.config.k8s.io/v1alpha1\",\
             \"hostnameOverride\":\"a\\u003cb\\u003e\\u0026c\",\"kind\":\"KubeProxyConfiguration\",\
             \"mode\":\"nftables\"}}"
        );
        // Escaped or not, it is the same JSON.
        let back: serde_json::Value = serde_json::from_str(&configz_body(&config)).unwrap();
        assert_eq!(back[CONFIGZ_KEY], config);
    }

    #[tokio::test]
    async fn answers_configz_metrics_proxy_mode_and_healthz() {
        let configz = configz_body(&json!({"mode": "nftables"}));

        let resp = answer("/configz", "nftables", &configz);
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(header(&resp, "content-type"), "application/json");
        assert_eq!(header(&resp, "x-content-type-options"), "nosniff");
        assert_eq!(
            body(resp).await,
            "{\"kubeproxy.config.k8s.io\":{\"mode\":\"nftables\"}}"
        );

        let resp = answer("/proxyMode", "iptables", &configz);
        assert_eq!(header(&resp, "content-type"), "text/plain; charset=utf-8");
        assert_eq!(body(resp).await, "iptables");

        let resp = answer("/healthz", "nftables", &configz);
        assert_eq!(body(resp).await, "ok");

        let resp = answer("/metrics", "nftables", &configz);
        assert_eq!(header(&resp, "content-type"), metrics::CONTENT_TYPE);
        assert!(
            body(resp)
                .await
                .contains("# TYPE nftproxy_build_info gauge\n")
        );

        let resp = answer("/configz/x", "nftables", &configz);
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn serves_configz_over_http() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let config = json!({"kind": "KubeProxyConfiguration", "mode": "nftables"});
        let server = tokio::spawn(super::super::serve(
            listener,
            handler("nftables", &config),
            super::super::Limits::metrics(),
            super::super::Budget::new(16, 16, 16),
            "metrics",
        ));
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /configz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).await.unwrap();
        server.abort();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(
            text.contains("\r\nContent-Type: application/json\r\n"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "\r\n\r\n{\"kubeproxy.config.k8s.io\":{\"kind\":\"KubeProxyConfiguration\",\"mode\":\"nftables\"}}"
            ),
            "{text}"
        );
    }
}
