//! The HTTP side: routing, discovery documents, LIST with pages, WATCH streams, writes.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response};
use serde_json::{Value, json};
use tokio::time::{Instant, sleep_until};

use super::Shared;
use super::selector::{FieldSelector, Filter, LabelSelector};
use super::store::{ApiError, ChangeType, KINDS, Kind};

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Serves one request (after logging it and waiting out a stall).
pub async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let uri = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let entry = shared.log_request(req.method().as_str(), &uri);
    let _ = shared.stall.subscribe().wait_for(|stalled| !stalled).await;
    let resp = match authenticate(&shared, &req) {
        Ok(()) => route(&shared, req).await,
        Err(e) => Err(e),
    };
    let resp = resp.unwrap_or_else(|e| json_response(e.code, &e.status()));
    shared.log_status(entry, resp.status().as_u16());
    Ok(resp)
}

/// Checks the bearer token, when one is required.
fn authenticate(shared: &Shared, req: &Request<Incoming>) -> Result<(), ApiError> {
    let Some(want) = &shared.required_token else {
        return Ok(());
    };
    let got = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if got == Some(want.as_str()) {
        Ok(())
    } else {
        Err(ApiError::new(401, "Unauthorized", "Unauthorized"))
    }
}

async fn route(shared: &Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_string();
    let query = parse_query(req.uri().query().unwrap_or(""));
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let get = req.method() == Method::GET;
    let (group, version, rest) = match segs.as_slice() {
        ["version"] if get => {
            return Ok(json_response(
                200,
                &json!({
                    "major": "1", "minor": "33", "gitVersion": "v1.33.0-nftproxy-test",
                    "platform": "linux/amd64",
                }),
            ));
        }
        ["api"] if get => {
            return Ok(json_response(
                200,
                &json!({"kind": "APIVersions", "versions": ["v1"]}),
            ));
        }
        ["apis"] if get => return Ok(json_response(200, &group_list(shared))),
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(not_found(&path)),
    };
    let served = |k: &&Kind| {
        k.group == group
            && k.version == version
            && (k.kind != "ServiceCIDR" || shared.serve_servicecidrs.load(Ordering::Relaxed))
    };
    if rest.is_empty() && get && KINDS.iter().any(|k| served(&k)) {
        return Ok(json_response(200, &resource_list(group, version, served)));
    }
    let (ns, plural, name) = match rest {
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        _ => return Err(not_found(&path)),
    };
    let kind = KINDS
        .iter()
        .find(|k| served(k) && k.plural == plural && (ns.is_none() || k.namespaced))
        .filter(|k| name.is_none() || ns.is_some() || !k.namespaced)
        .ok_or_else(|| not_found(&path))?;
    if let Some(code) = shared.failure(kind.plural) {
        let err = injected(code, kind, req.method(), name, &query);
        let retry_after = shared.retry_after_secs.load(Ordering::Relaxed);
        if retry_after > 0 && (code == 429 || code >= 500) {
            let mut status = err.status();
            status["details"] = json!({"retryAfterSeconds": retry_after});
            let mut resp = json_response(code, &status);
            resp.headers_mut()
                .insert("retry-after", retry_after.to_string().parse().unwrap());
            return Ok(resp);
        }
        return Err(err);
    }
    let ns = ns.map(str::to_string);
    match (req.method().clone(), name) {
        (Method::GET, None) if is_true(query.get("watch")) => watch(shared, kind, ns, &query),
        (Method::GET, None) => {
            let delay = shared.list_delay();
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            list(shared, kind, ns, &query)
        }
        (Method::GET, Some(name)) => {
            let store = shared.store();
            let obj = store.get(kind, ns.as_deref().unwrap_or(""), name);
            obj.map(|o| json_response(200, o))
                .ok_or_else(|| not_found_object(kind, name))
        }
        (Method::DELETE, Some(name)) => {
            let obj = shared.delete(kind, ns.as_deref().unwrap_or(""), name)?;
            Ok(json_response(200, &obj))
        }
        (method @ (Method::POST | Method::PUT), name) => {
            let (create, replace) = (method == Method::POST, method == Method::PUT);
            if create == name.is_some() {
                return Err(ApiError::new(
                    405,
                    "MethodNotAllowed",
                    format!("{method} {path}"),
                ));
            }
            let body = req
                .into_body()
                .collect()
                .await
                .map_err(bad_request)?
                .to_bytes();
            let obj: Value = serde_json::from_slice(&body).map_err(bad_request)?;
            let meta_ns = obj["metadata"]["namespace"].as_str().unwrap_or("");
            if obj["kind"] != kind.kind
                || name.is_some_and(|n| obj["metadata"]["name"] != n)
                || ns
                    .as_ref()
                    .is_some_and(|ns| !meta_ns.is_empty() && meta_ns != ns)
            {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    "object does not match the path",
                ));
            }
            let mut obj = obj;
            if let Some(ns) = &ns {
                obj["metadata"]["namespace"] = ns.clone().into();
            }
            let stored = shared.write(obj, create, replace)?;
            Ok(json_response(if create { 201 } else { 200 }, &stored))
        }
        (method, _) => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{method} {path}"),
        )),
    }
}

fn list(
    shared: &Shared,
    kind: &'static Kind,
    ns: Option<String>,
    q: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    let filter = filter(ns, q)?;
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => usize::MAX,
        Some(Ok(0)) => usize::MAX,
        Some(Ok(n)) => n,
        Some(Err(_)) => return Err(ApiError::new(400, "BadRequest", "invalid limit")),
    };
    let store = shared.store();
    let rv_param = q.get("resourceVersion").map(String::as_str).unwrap_or("");
    let (at, start) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let (rv, start) = decode_continue(token)?;
            (Some(rv), Some(start))
        }
        None if rv_param.is_empty() || rv_param == "0" => (None, None),
        None => {
            let rv: u64 = rv_param
                .parse()
                .map_err(|_| ApiError::new(400, "BadRequest", "invalid resourceVersion"))?;
            if rv > store.rv() {
                return Err(ApiError::new(
                    504,
                    "Timeout",
                    format!("Too large resource version: {rv}, current: {}", store.rv()),
                ));
            }
            let exact = q.get("resourceVersionMatch").map(String::as_str) == Some("Exact");
            (exact.then_some(rv), None)
        }
    };
    let (page, more) = store
        .page(kind, at, start.as_ref(), limit, |o| filter.matches(o))
        .map_err(|e| match start {
            Some(_) => ApiError::expired(
                "The provided continue parameter is too old to display a consistent list result. \
                 You can start a new list without the continue parameter.",
            ),
            None => e,
        })?;
    let list_rv = at.unwrap_or(store.rv());
    drop(store);
    let mut meta = json!({"resourceVersion": list_rv.to_string()});
    // No remainingItemCount: the API server leaves it out of selected lists too, and counting
    // would cost the rest of the list.
    if let (true, Some((last, _))) = (more, page.last()) {
        meta["continue"] = encode_continue(list_rv, &last.1, &last.2).into();
    }
    let items: Vec<Value> = page.into_iter().map(|(_, o)| o).collect();
    Ok(json_response(
        200,
        &json!({
            "kind": format!("{}List", kind.kind), "apiVersion": kind.api_version(),
            "metadata": meta, "items": items,
        }),
    ))
}

/// The state of one watch stream, polled by the response body.
struct Watch {
    shared: Arc<Shared>,
    kind: &'static Kind,
    filter: Filter,
    /// Every change up to this resourceVersion has been queued.
    rv: u64,
    queue: VecDeque<Bytes>,
    bookmarks: bool,
    next_bookmark: Instant,
    deadline: Instant,
    changed: tokio::sync::watch::Receiver<u64>,
    stall: tokio::sync::watch::Receiver<bool>,
    /// This stream's number, and the mute threshold ([`super::ApiServer::set_mute_watches`]).
    id: u64,
    mute: tokio::sync::watch::Receiver<u64>,
    done: bool,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.shared.active_watches.fetch_sub(1, Ordering::Relaxed);
    }
}

fn watch(
    shared: &Arc<Shared>,
    kind: &'static Kind,
    ns: Option<String>,
    q: &HashMap<String, String>,
) -> Result<Response<Body>, ApiError> {
    let filter = filter(ns, q)?;
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .unwrap_or(1800);
    let now = Instant::now();
    shared.active_watches.fetch_add(1, Ordering::Relaxed);
    let mut w = Watch {
        shared: shared.clone(),
        kind,
        filter,
        rv: 0,
        queue: VecDeque::new(),
        bookmarks: is_true(q.get("allowWatchBookmarks")),
        next_bookmark: now + shared.bookmark_interval(),
        deadline: now + Duration::from_secs(timeout),
        changed: shared.changed.subscribe(),
        stall: shared.stall.subscribe(),
        id: shared.watch_ids.fetch_add(1, Ordering::SeqCst),
        mute: shared.mute_below.subscribe(),
        done: false,
    };
    let rv_param = q.get("resourceVersion").map(String::as_str).unwrap_or("");
    if rv_param.is_empty() || rv_param == "0" {
        // Start at the most recent state: synthetic ADDED events for what exists now.
        let store = shared.store();
        w.rv = store.rv();
        for (_, obj) in store.snapshot(kind, None)? {
            if w.filter.matches(&obj) {
                w.push("ADDED", &obj);
            }
        }
        if is_true(q.get("sendInitialEvents")) {
            w.push("BOOKMARK", &w.bookmark(true));
        }
    } else {
        w.rv = rv_param
            .parse()
            .map_err(|_| ApiError::new(400, "BadRequest", "invalid resourceVersion"))?;
    }
    let stream = futures_util::stream::unfold(w, |mut w| async move {
        let data = w.next().await?;
        Some((Ok::<_, Infallible>(Frame::data(data)), w))
    });
    let mut resp = Response::new(BodyExt::boxed_unsync(StreamBody::new(stream)));
    resp.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    Ok(resp)
}

impl Watch {
    fn push(&mut self, ty: &str, obj: &Value) {
        let mut line = serde_json::to_vec(&json!({"type": ty, "object": obj})).unwrap();
        line.push(b'\n');
        self.queue.push_back(line.into());
    }

    fn bookmark(&self, initial_events_end: bool) -> Value {
        let mut meta = json!({"resourceVersion": self.rv.to_string()});
        if initial_events_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        json!({"kind": self.kind.kind, "apiVersion": self.kind.api_version(), "metadata": meta})
    }

    /// Queues the events for every change since `self.rv`, or the 410 ERROR event.
    fn fill(&mut self) {
        self.changed.borrow_and_update();
        let store = self.shared.store();
        let changes = match store.changes_after(self.kind, self.rv) {
            Ok(changes) => changes,
            Err(e) => {
                drop(store);
                self.push("ERROR", &e.status());
                self.done = true;
                return;
            }
        };
        self.rv = self.rv.max(store.rv());
        drop(store);
        for c in changes {
            let was = c.old.as_ref().is_some_and(|o| self.filter.matches(o));
            let is = c.ty != ChangeType::Deleted && self.filter.matches(&c.new);
            let ty = match (was, is) {
                (false, true) => "ADDED",
                (true, true) => "MODIFIED",
                (true, false) => "DELETED",
                (false, false) => continue,
            };
            if let (ChangeType::Modified, "DELETED", Some(old)) = (c.ty, ty, &c.old) {
                // Like the apiserver: the last matching state, at the new resourceVersion.
                let mut old = old.clone();
                old["metadata"]["resourceVersion"] = c.rv.to_string().into();
                self.push(ty, &old);
            } else {
                self.push(ty, &c.new);
            }
        }
    }

    /// The next chunk to send; `None` ends the stream.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if *self.stall.borrow_and_update() {
                self.stall.wait_for(|stalled| !stalled).await.ok()?;
                continue;
            }
            let id = self.id;
            if *self.mute.borrow_and_update() > id {
                self.mute.wait_for(|below| *below <= id).await.ok()?;
                continue;
            }
            if let Some(data) = self.queue.pop_front() {
                return Some(data);
            }
            if self.done {
                return None;
            }
            self.fill();
            if !self.queue.is_empty() {
                continue;
            }
            tokio::select! {
                r = self.changed.changed() => r.ok()?,
                _ = self.stall.changed() => {}
                _ = self.mute.changed() => {}
                _ = sleep_until(self.deadline) => self.done = true,
                _ = sleep_until(self.next_bookmark), if self.bookmarks => {
                    self.fill();
                    if !self.done {
                        self.push("BOOKMARK", &self.bookmark(false));
                    }
                    self.next_bookmark = Instant::now() + self.shared.bookmark_interval();
                }
            }
        }
    }
}

fn filter(namespace: Option<String>, q: &HashMap<String, String>) -> Result<Filter, ApiError> {
    let get = |k: &str| q.get(k).map(String::as_str).unwrap_or("");
    Ok(Filter {
        namespace,
        labels: LabelSelector::parse(get("labelSelector")).map_err(bad_request)?,
        fields: FieldSelector::parse(get("fieldSelector")).map_err(bad_request)?,
    })
}

fn group_list(shared: &Shared) -> Value {
    let mut groups: Vec<Value> = Vec::new();
    for k in KINDS.iter().filter(|k| !k.group.is_empty()) {
        if groups.iter().any(|g| g["name"] == k.group) {
            continue;
        }
        if k.kind == "ServiceCIDR" && !shared.serve_servicecidrs.load(Ordering::Relaxed) {
            continue;
        }
        let gv = json!({"groupVersion": k.api_version(), "version": k.version});
        groups.push(json!({"name": k.group, "versions": [gv.clone()], "preferredVersion": gv}));
    }
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn resource_list(group: &str, version: &str, served: impl Fn(&&Kind) -> bool) -> Value {
    let resources: Vec<Value> = KINDS
        .iter()
        .filter(served)
        .map(|k| {
            json!({
                "name": k.plural, "singularName": k.singular, "namespaced": k.namespaced,
                "kind": k.kind,
                "verbs": ["create", "delete", "get", "list", "update", "watch"],
            })
        })
        .collect();
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

fn json_response(code: u16, body: &Value) -> Response<Body> {
    let bytes = Bytes::from(serde_json::to_vec(body).unwrap());
    let mut resp = Response::new(BodyExt::boxed_unsync(Full::new(bytes)));
    *resp.status_mut() =
        hyper::StatusCode::from_u16(code).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    resp
}

/// The error [`super::ApiServer::set_fail`] injects, worded like the apiserver's.
fn injected(
    code: u16,
    kind: &Kind,
    method: &Method,
    name: Option<&str>,
    q: &HashMap<String, String>,
) -> ApiError {
    let verb = match (method.as_str(), name) {
        ("GET", None) if is_true(q.get("watch")) => "watch",
        ("GET", None) => "list",
        ("GET", Some(_)) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("DELETE", _) => "delete",
        (other, _) => other,
    };
    let resource = match kind.group {
        "" => kind.plural.to_string(),
        group => format!("{}.{group}", kind.plural),
    };
    let message = match code {
        403 => format!(
            "{resource} is forbidden: User \"system:serviceaccount:kube-system:kube-proxy\" \
             cannot {verb} resource \"{}\" in API group \"{}\" at the cluster scope",
            kind.plural, kind.group
        ),
        500 => format!("Internal error occurred: injected failure for {verb} {resource}"),
        _ => format!("injected {code} for {verb} {resource}"),
    };
    ApiError::new(code, reason_for(code), message)
}

/// The `Status` reason the apiserver gives with an HTTP status ("" when it has none).
fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Expired",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "",
    }
}

fn not_found(path: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("the server could not find the requested resource ({path})"),
    )
}

fn not_found_object(kind: &Kind, name: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("{} \"{name}\" not found", kind.plural),
    )
}

fn bad_request(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(400, "BadRequest", e.to_string())
}

fn is_true(v: Option<&String>) -> bool {
    v.is_some_and(|v| v == "true" || v == "1")
}

/// `a=1&&b=x%2Fy+z` → {a: 1, b: "x/y z"} (the last value of a repeated key wins).
fn parse_query(q: &str) -> HashMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let (b, mut out, mut i) = (s.as_bytes(), Vec::with_capacity(s.len()), 0);
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (b[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
                continue;
            }
            (b'+', _) => out.push(b' '),
            (c, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Continue tokens are opaque hex of `rv/namespace/name`.
fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    format!("{rv}/{ns}/{name}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_continue(token: &str) -> Result<(u64, (String, String)), ApiError> {
    let bad = || ApiError::new(400, "BadRequest", "continue key is not valid");
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes.ok_or_else(bad)?).map_err(|_| bad())?;
    let mut parts = text.splitn(3, '/');
    let (Some(rv), Some(ns), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    Ok((
        rv.parse().map_err(|_| bad())?,
        (ns.to_string(), name.to_string()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_and_tokens() {
        let q = parse_query("&labelSelector=%21a%2Fb,k+in+%28x%29&watch=1");
        assert_eq!(q["labelSelector"], "!a/b,k in (x)");
        assert!(is_true(q.get("watch")));
        let t = encode_continue(7, "default", "svc-a");
        assert_eq!(
            decode_continue(&t).unwrap(),
            (7, ("default".into(), "svc-a".into()))
        );
        assert!(decode_continue("zz").is_err());
    }
}
