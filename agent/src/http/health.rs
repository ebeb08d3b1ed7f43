//! kube-proxy's proxy health (`pkg/proxy/healthcheck/proxy_health.go`): `/healthz` and `/livez`.
//!
//! Per IP family, the time of the last successful sync and the oldest update queued since. The
//! proxy is healthy unless some family has had an update pending for `2 × syncPeriod` or more
//! (an idle proxy stays healthy; so does one starting up). `/livez` reports just that;
//! `/healthz` also needs this node to be eligible: known, not being deleted, not tainted
//! `ToBeDeletedByClusterAutoscaler` (so load balancers drain a node that is going away).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use dataplane::model::Node;
use dataplane::nft::ruleset::Family;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};

use super::{GO_ZERO_TIME, Handler, not_found, response, rfc3339_nano};

/// The Cluster Autoscaler's taint on nodes it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

#[derive(Debug, Default)]
struct Inner {
    last_updated: BTreeMap<Family, SystemTime>,
    /// When the oldest update not yet synced was queued.
    oldest_pending: BTreeMap<Family, Instant>,
    node_eligible: bool,
    /// Why the API server cannot be reached, when the reason is known and has a fix.
    api_problem: Option<String>,
    /// Families whose syncs are failing.
    sync_failures: BTreeMap<Family, SyncFailure>,
}

/// A family whose syncs fail, as `/healthz` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncFailure {
    /// Failures in a row.
    pub failures: u32,
    pub error: String,
    /// When the next attempt is due.
    pub retry_at: SystemTime,
}

/// The proxy's health, shared by the sources (queued updates), the sync loop (updates) and the
/// HTTP handlers.
#[derive(Debug, Default)]
pub struct HealthState {
    inner: Mutex<Inner>,
}

/// One family's health, as reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FamilyHealth {
    pub family: Family,
    pub last_updated: SystemTime,
    pub healthy: bool,
}

/// kube-proxy's `ProxyHealth`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyHealth {
    /// The most recent successful sync of any family (`None`: never).
    pub last_updated: Option<SystemTime>,
    pub current_time: SystemTime,
    pub healthy: bool,
    pub status: Vec<FamilyHealth>,
}

/// kube-proxy's `NodeEligible`: the Node is known, not being deleted and not about to be.
pub fn node_eligible(node: Option<&Node>) -> bool {
    node.is_some_and(|n| !n.deleting && !n.taint_keys.iter().any(|k| k == TO_BE_DELETED_TAINT))
}

impl HealthState {
    pub fn new() -> HealthState {
        HealthState::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An update that needs a sync was received (kept if one is already pending).
    pub fn queued_update(&self, family: Family) {
        self.lock()
            .oldest_pending
            .entry(family)
            .or_insert_with(Instant::now);
    }

    /// `family` was synced successfully: nothing is pending any more.
    pub fn updated(&self, family: Family) {
        let mut inner = self.lock();
        inner.oldest_pending.remove(&family);
        inner.last_updated.insert(family, SystemTime::now());
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    pub fn node_eligible(&self) -> bool {
        self.lock().node_eligible
    }

    /// Sets (or clears) the reason the API server cannot be reached, shown by `/healthz`.
    pub fn set_api_problem(&self, problem: Option<String>) {
        self.lock().api_problem = problem;
    }

    pub fn api_problem(&self) -> Option<String> {
        self.lock().api_problem.clone()
    }

    /// Sets (or clears, after a success) `family`'s failing syncs.
    pub fn set_sync_failure(&self, family: Family, failure: Option<SyncFailure>) {
        let mut inner = self.lock();
        match failure {
            Some(f) => inner.sync_failures.insert(family, f),
            None => inner.sync_failures.remove(&family),
        };
    }

    pub fn sync_failures(&self) -> BTreeMap<Family, SyncFailure> {
        self.lock().sync_failures.clone()
    }

    /// kube-proxy's `Health()`.
    pub fn health(&self, timeout: Duration) -> ProxyHealth {
        let inner = self.lock();
        let now = Instant::now();
        let mut healthy = true;
        let mut status = Vec::new();
        for (&family, &last_updated) in &inner.last_updated {
            let late = inner
                .oldest_pending
                .get(&family)
                .is_some_and(|&queued| now.duration_since(queued) >= timeout);
            healthy &= !late;
            status.push(FamilyHealth {
                family,
                last_updated,
                healthy: !late,
            });
        }
        ProxyHealth {
            last_updated: inner.last_updated.values().max().copied(),
            current_time: SystemTime::now(),
            healthy,
            status,
        }
    }
}

fn time(t: Option<SystemTime>) -> String {
    t.map(rfc3339_nano)
        .unwrap_or_else(|| GO_ZERO_TIME.to_string())
}

/// What nftproxy adds to kube-proxy's health JSON (each left out when there is nothing to say).
#[derive(Clone, Debug, Default)]
pub struct Extra {
    /// `apiServer`: why the API server cannot be reached, when that is known.
    pub api_problem: Option<String>,
    /// `syncFailures`: families whose syncs are failing.
    pub sync_failures: BTreeMap<Family, SyncFailure>,
}

/// The JSON kube-proxy writes (`json.Marshal(ProxyHealth)`): keys in struct order, `status`
/// keyed by family name and left out when empty; then nftproxy's [`Extra`] fields.
pub fn health_json(h: &ProxyHealth, node_eligible: Option<bool>, extra: &Extra) -> String {
    let mut out = format!(
        "{{\"lastUpdated\":\"{}\",\"currentTime\":\"{}\"",
        time(h.last_updated),
        rfc3339_nano(h.current_time)
    );
    if let Some(e) = node_eligible {
        out.push_str(&format!(",\"nodeEligible\":{e}"));
    }
    out.push_str(&format!(",\"healthy\":{}", h.healthy));
    if !h.status.is_empty() {
        let parts: Vec<String> = h
            .status
            .iter()
            .map(|s| {
                format!(
                    "\"{}\":{{\"lastUpdated\":\"{}\",\"healthy\":{}}}",
                    s.family.k8s_name(),
                    rfc3339_nano(s.last_updated),
                    s.healthy
                )
            })
            .collect();
        out.push_str(&format!(",\"status\":{{{}}}", parts.join(",")));
    }
    if let Some(problem) = &extra.api_problem {
        out.push_str(",\"apiServer\":");
        out.push_str(&serde_json::Value::from(problem.as_str()).to_string());
    }
    if !extra.sync_failures.is_empty() {
        let failures: serde_json::Map<String, serde_json::Value> = extra
            .sync_failures
            .iter()
            .map(|(family, f)| {
                let v = serde_json::json!({
                    "failures": f.failures,
                    "error": f.error,
                    "retryAt": rfc3339_nano(f.retry_at),
                });
                (family.k8s_name().to_string(), v)
            })
            .collect();
        out.push_str(",\"syncFailures\":");
        out.push_str(&serde_json::Value::Object(failures).to_string());
    }
    out.push('}');
    out
}

/// The `/healthz` and `/livez` handler.
pub fn handler(state: Arc<HealthState>, timeout: Duration) -> Handler {
    Arc::new(move |req: &Request<hyper::body::Incoming>| {
        let healthz = match req.uri().path() {
            "/healthz" => true,
            "/livez" => false,
            _ => return not_found(),
        };
        answer(&state, timeout, healthz)
    })
}

/// One `/healthz` (`healthz = true`) or `/livez` answer.
pub fn answer(state: &HealthState, timeout: Duration, healthz: bool) -> Response<Full<Bytes>> {
    let mut h = state.health(timeout);
    let eligible = healthz.then(|| state.node_eligible());
    // An unreachable API server is reported by /healthz (readiness), not /livez: restarting
    // the agent does not fix its address.
    let extra = Extra {
        api_problem: healthz.then(|| state.api_problem()).flatten(),
        sync_failures: state.sync_failures(),
    };
    let ok = h.healthy && eligible.unwrap_or(true) && extra.api_problem.is_none();
    let m = metrics::metrics();
    let code = if ok { 200 } else { 503 };
    if healthz {
        m.healthz(code);
    } else {
        m.livez(code);
    }
    if ok {
        // kube-proxy: "lastUpdated is recent if healthy" (compatibility with old releases).
        h.last_updated = Some(SystemTime::now());
    }
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    response(
        status,
        &[
            ("Content-Type", "application/json".into()),
            ("X-Content-Type-Options", "nosniff".into()),
        ],
        health_json(&h, eligible, &extra),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_until_an_update_is_late() {
        let s = HealthState::new();
        // Starting up: nothing synced, nothing queued.
        let h = s.health(Duration::from_millis(50));
        assert!(h.healthy && h.status.is_empty() && h.last_updated.is_none());
        s.updated(Family::V4);
        s.updated(Family::V6);
        s.queued_update(Family::V4);
        assert!(s.health(Duration::from_millis(50)).healthy);
        std::thread::sleep(Duration::from_millis(60));
        let h = s.health(Duration::from_millis(50));
        assert!(!h.healthy);
        assert_eq!(
            h.status.iter().map(|f| f.healthy).collect::<Vec<_>>(),
            [false, true]
        );
        s.updated(Family::V4);
        assert!(s.health(Duration::from_millis(50)).healthy);
    }

    #[test]
    fn json_is_kube_proxys() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_764_690_806, 5_000);
        let h = ProxyHealth {
            last_updated: Some(t),
            current_time: t,
            healthy: false,
            status: vec![
                FamilyHealth {
                    family: Family::V4,
                    last_updated: t,
                    healthy: false,
                },
                FamilyHealth {
                    family: Family::V6,
                    last_updated: t,
                    healthy: true,
                },
            ],
        };
        let ts = "2025-12-02T15:53:26.000005Z";
        assert_eq!(
            health_json(&h, Some(true), &Extra::default()),
            format!(
                "{{\"lastUpdated\":\"{ts}\",\"currentTime\":\"{ts}\",\"nodeEligible\":true,\
                 \"healthy\":false,\"status\":{{\"IPv4\":{{\"lastUpdated\":\"{ts}\",\"healthy\":false}},\
                 \"IPv6\":{{\"lastUpdated\":\"{ts}\",\"healthy\":true}}}}}}"
            )
        );
        let empty = ProxyHealth {
            last_updated: None,
            current_time: t,
            healthy: true,
            status: vec![],
        };
        assert_eq!(
            health_json(&empty, None, &Extra::default()),
            format!(
                "{{\"lastUpdated\":\"0001-01-01T00:00:00Z\",\"currentTime\":\"{ts}\",\"healthy\":true}}"
            )
        );
    }

    #[test]
    fn an_api_problem_fails_healthz_with_its_reason() {
        let t = SystemTime::UNIX_EPOCH;
        let h = ProxyHealth {
            last_updated: None,
            current_time: t,
            healthy: true,
            status: vec![],
        };
        let extra = Extra {
            api_problem: Some("the \"address\" is a ClusterIP".into()),
            sync_failures: [(
                Family::V6,
                SyncFailure {
                    failures: 3,
                    error: "nftables rejected the transaction".into(),
                    retry_at: t,
                },
            )]
            .into(),
        };
        let json = health_json(&h, Some(false), &extra);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["apiServer"], "the \"address\" is a ClusterIP");
        assert_eq!(v["syncFailures"]["IPv6"]["failures"], 3);
        assert_eq!(v["syncFailures"]["IPv6"]["retryAt"], "1970-01-01T00:00:00Z");
        let s = HealthState::new();
        s.set_node_eligible(true);
        assert_eq!(answer(&s, Duration::from_secs(1), true).status(), 200);
        s.set_api_problem(Some("unreachable".into()));
        assert_eq!(answer(&s, Duration::from_secs(1), true).status(), 503);
        assert_eq!(
            answer(&s, Duration::from_secs(1), false).status(),
            200,
            "/livez stays up"
        );
        s.set_api_problem(None);
        assert_eq!(answer(&s, Duration::from_secs(1), true).status(), 200);
    }

    #[test]
    fn node_eligibility() {
        let mut n = Node::default();
        assert!(!node_eligible(None));
        assert!(node_eligible(Some(&n)));
        n.taint_keys = vec![TO_BE_DELETED_TAINT.into()];
        assert!(!node_eligible(Some(&n)));
        n.taint_keys.clear();
        n.deleting = true;
        assert!(!node_eligible(Some(&n)));
    }
}
