use std::convert::Infallible;
use std::time::Duration;

use hyper::StatusCode;
use kube::api::ListParams;
use tower::Layer;

use super::*;

/// A paging server: answers a list by its `continue` token (`None`: the first page) and logs
/// every request's URI.
#[derive(Clone, Default)]
struct Pager {
    pages: Arc<HashMap<Option<String>, (StatusCode, String)>>,
    asked: Arc<Mutex<Vec<String>>>,
}

impl Pager {
    fn new(pages: &[(Option<&str>, StatusCode, &str)]) -> Pager {
        Pager {
            pages: Arc::new(
                pages
                    .iter()
                    .map(|(token, status, body)| {
                        (token.map(str::to_string), (*status, body.to_string()))
                    })
                    .collect(),
            ),
            asked: Arc::default(),
        }
    }

    fn asked(&self) -> Vec<String> {
        lock(&self.asked).clone()
    }

    /// Waits until `n` requests were made (the prefetch runs in a task of its own).
    async fn wait_asked(&self, n: usize) -> Vec<String> {
        for _ in 0..200 {
            if self.asked().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.asked()
    }
}

impl Service<Request<kube::client::Body>> for Pager {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<kube::client::Body>) -> Self::Future {
        lock(&self.asked).push(req.uri().to_string());
        let token = form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes())
            .find(|(k, _)| k == "continue")
            .map(|(_, v)| v.into_owned());
        let (status, body) = self
            .pages
            .get(&token)
            .cloned()
            .unwrap_or((StatusCode::NOT_FOUND, "{}".into()));
        let mut resp = Response::new(Full::new(Bytes::from(body)));
        *resp.status_mut() = status;
        std::future::ready(Ok(resp))
    }
}

/// A page of a list: `continue` empty on the last page, as the API server sends it.
fn page(items: &str, token: &str) -> String {
    format!(
        r#"{{"kind":"ServiceList","apiVersion":"v1","metadata":{{"resourceVersion":"7","continue":"{token}"}},"items":[{items}]}}"#
    )
}

/// The request kube makes for a page of the watcher's list (`continue_token` None: the first).
fn list(continue_token: Option<&str>) -> Request<kube::client::Body> {
    let mut params = ListParams::default()
        .labels("!service.kubernetes.io/headless")
        .limit(2)
        .match_any();
    params.continue_token = continue_token.map(str::to_string);
    let req = kube::core::Request::new("/api/v1/services")
        .list(&params)
        .unwrap();
    req.map(kube::client::Body::from)
}

async fn body_of(resp: Response<PrefetchBody<Full<Bytes>>>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn three_pages() -> Pager {
    Pager::new(&[
        (None, StatusCode::OK, &page(r#"{"a":1}"#, "t1+/=")),
        (Some("t1+/="), StatusCode::OK, &page(r#"{"b":2}"#, "t2")),
        (Some("t2"), StatusCode::OK, &page(r#"{"c":3}"#, "")),
    ])
}

#[tokio::test]
async fn each_page_is_asked_for_as_soon_as_the_one_before_arrives() {
    let pager = three_pages();
    let mut svc = PrefetchLayer.layer(pager.clone());
    let first = svc.call(list(None)).await.unwrap();
    assert!(body_of(first).await.contains(r#"{"a":1}"#));
    // The second page is asked for before the watcher asks, with the URI kube will ask for.
    let asked = pager.wait_asked(2).await;
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert_eq!(asked[1], list(Some("t1+/=")).uri().to_string());

    let second = svc.call(list(Some("t1+/="))).await.unwrap();
    assert!(body_of(second).await.contains(r#"{"b":2}"#));
    let third = svc.call(list(Some("t2"))).await.unwrap();
    assert!(body_of(third).await.contains(r#"{"c":3}"#));
    // Each page was asked for once, and nothing after the last.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(pager.asked().len(), 3, "{:?}", pager.asked());
}

#[tokio::test]
async fn a_page_asked_for_ahead_answers_only_the_same_request() {
    let pager = three_pages();
    let mut svc = PrefetchLayer.layer(pager.clone());
    svc.call(list(None)).await.unwrap();
    pager.wait_asked(2).await;
    // The watcher started over instead: its request goes to the server, and the page asked
    // for ahead is not handed to it.
    let again = svc.call(list(None)).await.unwrap();
    assert!(body_of(again).await.contains(r#"{"a":1}"#));
    let asked = pager.wait_asked(4).await;
    assert_eq!(asked[2], list(None).uri().to_string());
    // A request with other headers is not answered with it either.
    let mut other = list(Some("t1+/="));
    other
        .headers_mut()
        .insert(ACCEPT, HeaderValue::from_static("application/yaml"));
    svc.call(other).await.unwrap();
    assert_eq!(pager.wait_asked(5).await.len(), 5);
}

#[tokio::test]
async fn a_failed_page_asked_for_ahead_is_the_answer_the_watcher_gets() {
    let gone = r#"{"kind":"Status","code":410,"reason":"Expired"}"#;
    let pager = Pager::new(&[
        (None, StatusCode::OK, &page("", "t1")),
        (Some("t1"), StatusCode::GONE, gone),
    ]);
    let mut svc = PrefetchLayer.layer(pager.clone());
    svc.call(list(None)).await.unwrap();
    pager.wait_asked(2).await;
    let resp = svc.call(list(Some("t1"))).await.unwrap();
    assert_eq!(resp.status(), StatusCode::GONE);
    assert_eq!(body_of(resp).await, gone);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(pager.asked().len(), 2);
}

#[tokio::test]
async fn other_requests_stream_and_ask_for_nothing_more() {
    let pager = Pager::new(&[(None, StatusCode::OK, &page("", "t1"))]);
    let mut svc = PrefetchLayer.layer(pager.clone());
    // A watch, and a list that is not paged: passed through as they stream.
    for uri in [
        "/api/v1/services?watch=true&limit=2&resourceVersion=7",
        "/api/v1/services",
    ] {
        let req = Request::get(uri)
            .body(kube::client::Body::from(Vec::new()))
            .unwrap();
        let resp = svc.call(req).await.unwrap();
        assert!(matches!(resp.body(), Either::Left(_)));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(pager.asked().len(), 2);
}

#[test]
fn the_continue_token_is_read_from_the_list_metadata_only() {
    assert_eq!(
        continue_token(page("", "abc").as_bytes()),
        Some("abc".into())
    );
    assert_eq!(continue_token(page("", "").as_bytes()), None);
    // An object's own `continue` field (say an annotation) is not the list's.
    let body = r#"{"items":[{"metadata":{"annotations":{"continue":"x"}}}],"metadata":{}}"#;
    assert_eq!(continue_token(body.as_bytes()), None);
    assert_eq!(continue_token(b"not json"), None);
}
