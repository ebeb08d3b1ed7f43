//! Per-Service health-check node ports (kube-proxy's `service_health.go`).
//!
//! Every LoadBalancer Service with `externalTrafficPolicy: Local` has a `healthCheckNodePort`;
//! the load balancer probes it on each node and sends traffic only to nodes that answer 200,
//! i.e. nodes with a ready endpoint of the Service. One listener per port and node address
//! selected by `nodePortAddresses` (a wildcard per family when they match everything), opened
//! and closed after each successful sync as Services come and go. A port that cannot be bound
//! is logged and retried at the next sync.
//!
//! The answer (any method, any path) carries the number of distinct local ready endpoint IPs of
//! the listener's IP family, in the body and in `X-Load-Balancing-Endpoint-Weight`; it is 200
//! when that number is not 0 and the proxy is healthy (see [`super::health`]), else 503. The
//! ports and counts are `dataplane::decision::health_check`'s.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dataplane::decision::{HealthCheck, health_check};
use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::{BuildConfig, NodePortIps, node_port_ips};
use dataplane::nft::ruleset::Family;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use super::health::HealthState;
use super::{Budget, Handler, Limits, listen, response, serve};

fn family_index(f: Family) -> usize {
    match f {
        Family::V4 => 0,
        Family::V6 => 1,
    }
}

/// What the handlers of one Service read.
#[derive(Debug)]
struct Counts {
    name: ObjectName,
    /// Local ready endpoints, per family.
    local_ready: [AtomicUsize; 2],
}

struct Entry {
    port: u16,
    counts: Arc<Counts>,
    listeners: BTreeMap<SocketAddr, JoinHandle<()>>,
    /// Addresses whose bind failure was already logged at warning level.
    warned: BTreeSet<SocketAddr>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        for task in self.listeners.values() {
            task.abort();
        }
    }
}

/// The health-check node port listeners of all Services.
pub struct ServiceHealth {
    rt: Handle,
    health: Arc<HealthState>,
    timeout: Duration,
    services: BTreeMap<ObjectName, Entry>,
}

/// The body kube-proxy writes: tab-indented, no trailing newline.
pub fn body(name: &ObjectName, count: usize, healthy: bool) -> String {
    let q = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""));
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\
         \"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        q(&name.namespace),
        q(&name.name)
    )
}

/// One answer of a health-check node port.
pub fn answer(name: &ObjectName, count: usize, proxy_healthy: bool) -> Response<Full<Bytes>> {
    let status = if count != 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    response(
        status,
        &[
            ("Content-Type", "application/json".into()),
            ("X-Content-Type-Options", "nosniff".into()),
            ("X-Load-Balancing-Endpoint-Weight", count.to_string()),
        ],
        body(name, count, proxy_healthy),
    )
}

/// The addresses a health-check node port listens on: the node addresses `nodePortAddresses`
/// selects, or the family's wildcard address when it selects them all.
pub fn listen_addresses(cluster: &Cluster, config: &BuildConfig, port: u16) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for family in Family::ALL {
        match node_port_ips(config, cluster, family).without_loopback() {
            NodePortIps::All => out.push(SocketAddr::new(
                match family {
                    Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                    Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                },
                port,
            )),
            NodePortIps::List(ips) => {
                out.extend(ips.into_iter().map(|ip| SocketAddr::new(ip, port)))
            }
        }
    }
    out
}

impl ServiceHealth {
    pub fn new(rt: Handle, health: Arc<HealthState>, timeout: Duration) -> ServiceHealth {
        ServiceHealth {
            rt,
            health,
            timeout,
            services: BTreeMap::new(),
        }
    }

    /// Ports currently listened on, per Service (for tests and logs).
    pub fn listening(&self) -> BTreeMap<ObjectName, Vec<SocketAddr>> {
        self.services
            .iter()
            .map(|(n, e)| (n.clone(), e.listeners.keys().copied().collect()))
            .collect()
    }

    /// After a successful sync: opens and closes listeners, updates the endpoint counts.
    pub fn sync(&mut self, cluster: &Cluster, config: &BuildConfig) {
        let desired: BTreeMap<&ObjectName, HealthCheck> = cluster
            .services
            .values()
            .filter_map(|s| health_check(cluster, s, &config.node_name).map(|h| (&s.name, h)))
            .collect();
        self.services.retain(|name, entry| {
            let keep = desired.get(name).map(|h| h.node_port) == Some(entry.port);
            if !keep {
                tracing::info!(service = %name, port = entry.port, "closing health-check node port");
            }
            keep
        });
        for (name, check) in desired {
            let port = check.node_port;
            let entry = self.services.entry(name.clone()).or_insert_with(|| Entry {
                port,
                counts: Arc::new(Counts {
                    name: name.clone(),
                    local_ready: [AtomicUsize::new(0), AtomicUsize::new(0)],
                }),
                listeners: BTreeMap::new(),
                warned: BTreeSet::new(),
            });
            for family in Family::ALL {
                let n = check.local_ready(family);
                entry.counts.local_ready[family_index(family)].store(n, Ordering::Relaxed);
            }
            let addrs: BTreeSet<SocketAddr> = listen_addresses(cluster, config, port)
                .into_iter()
                .collect();
            entry.listeners.retain(|addr, task| {
                let keep = addrs.contains(addr);
                if !keep {
                    task.abort();
                }
                keep
            });
            for addr in addrs {
                if entry.listeners.contains_key(&addr) {
                    continue;
                }
                // A wildcard IPv6 listener must leave IPv4 to the IPv4 one.
                match listen(addr, true) {
                    Ok(l) => {
                        tracing::info!(service = %name, %addr, "serving health-check node port");
                        entry.warned.remove(&addr);
                        let handler = handler(
                            &entry.counts,
                            Family::of(&addr.ip()),
                            &self.health,
                            self.timeout,
                        );
                        let task = self.rt.spawn(async move {
                            match TcpListener::from_std(l) {
                                Ok(l) => {
                                    serve(
                                        l,
                                        handler,
                                        Limits::health(),
                                        Budget::shared(),
                                        "service-health",
                                    )
                                    .await
                                }
                                Err(e) => {
                                    tracing::error!(%addr, error = %e, "health-check listener")
                                }
                            }
                        });
                        entry.listeners.insert(addr, task);
                    }
                    Err(e) => {
                        // kube-proxy: event FailedToStartServiceHealthcheck, retried next sync.
                        if entry.warned.insert(addr) {
                            tracing::warn!(service = %name, %addr, error = %e, "failed to start health-check node port; retrying at every sync");
                        } else {
                            tracing::debug!(service = %name, %addr, error = %e, "health-check node port still unavailable");
                        }
                    }
                }
            }
        }
    }
}

fn handler(
    counts: &Arc<Counts>,
    family: Family,
    health: &Arc<HealthState>,
    timeout: Duration,
) -> Handler {
    let counts = counts.clone();
    let health = health.clone();
    Arc::new(move |_req: &Request<hyper::body::Incoming>| {
        let n = counts.local_ready[family_index(family)].load(Ordering::Relaxed);
        answer(&counts.name, n, health.health(timeout).healthy)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_kube_proxys() {
        assert_eq!(
            body(&ObjectName::new("ns1", "svc1"), 1, true),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns1\",\n\t\t\"name\": \"svc1\"\n\t},\n\t\"localEndpoints\": 1,\n\t\"serviceProxyHealthy\": true\n}"
        );
    }
}
