//! The soak cluster as the API server stores it, the churn's random choices, and timestamps.
//!
//! Service `i` (0-based) is `ns-<i/100>/svc-<i>`: ClusterIP `172.16.0.10 + i`, one TCP port
//! `http` 80 → 8080, and one EndpointSlice `svc-<i>-soak` with k ready endpoints. Endpoints are
//! pod IPs from a pool `10.64.0.0 + n` (n < pool size): Service `i` starts with pods
//! `i*k .. i*k + k` (modulo the pool), and every churn step gives one random slice k distinct
//! random pods of the pool. One pod in five runs on this node, the others on `node-b`.

use std::net::Ipv4Addr;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// The node the agent runs as (the config's `hostnameOverride`).
pub const NODE: &str = "soak-node";
pub const NODE_IP: &str = "192.168.0.2";
/// Pod network (`clusterCIDR`).
pub const CLUSTER_CIDR: &str = "10.0.0.0/8";
const PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
/// `endpoints.kubernetes.io/last-change-trigger-time`: the agent's network programming
/// latency is measured from it.
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The agent's configuration file.
pub fn kube_proxy_config(min_sync_period: &str, sync_period: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
         kind: KubeProxyConfiguration\n\
         mode: nftables\n\
         clusterCIDR: {CLUSTER_CIDR}\n\
         hostnameOverride: {NODE}\n\
         nftables:\n  \
           minSyncPeriod: {min_sync_period}\n  \
           syncPeriod: {sync_period}\n"
    )
}

fn namespace(i: usize) -> String {
    format!("ns-{}", i / 100)
}

fn service_name(i: usize) -> String {
    format!("svc-{i}")
}

fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(172, 16, 0, 10)) + i as u32)
}

/// Pod `n` of the pool.
pub fn pod_ip(n: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 64, 0, 0)) + n as u32)
}

/// The Services' IPs must stay inside 172.16.0.0/12 and the pods inside 10.0.0.0/8.
pub const MAX_SERVICES: usize = (1 << 20) - 10;
pub const MAX_POD_IPS: usize = 1 << 22;

pub fn service(i: usize) -> Value {
    let ip = cluster_ip(i).to_string();
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service_name(i), "namespace": namespace(i)},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": ip, "clusterIPs": [ip],
            "ipFamilies": ["IPv4"],
            "ports": [{"name": "http", "port": PORT, "protocol": "TCP", "targetPort": TARGET_PORT}],
        }
    })
}

/// The EndpointSlice of Service `i` with the pods `pods` of the pool.
pub fn slice(i: usize, pods: &[usize], trigger_time: Option<&str>) -> Value {
    let mut metadata = json!({
        "name": format!("{}-soak", service_name(i)),
        "namespace": namespace(i),
        "labels": {
            "kubernetes.io/service-name": service_name(i),
            "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
        },
    });
    if let Some(t) = trigger_time {
        metadata["annotations"] = json!({ TRIGGER_TIME: t });
    }
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|&n| {
            let node = if n % 5 == 0 { NODE } else { "node-b" };
            json!({
                "addresses": [pod_ip(n).to_string()],
                "nodeName": node,
                "conditions": {"ready": true, "serving": true, "terminating": false},
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": metadata,
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    })
}

/// The pods Service `i` starts with.
pub fn initial_pods(i: usize, k: usize, pool: usize) -> Vec<usize> {
    (0..k).map(|j| (i * k + j) % pool).collect()
}

/// splitmix64: small, fast and good enough to pick slices and pods.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// `k` distinct values of `0..n` (k <= n), in the order drawn.
    pub fn distinct(&mut self, k: usize, n: usize) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::with_capacity(k);
        while out.len() < k {
            let v = self.below(n);
            if !out.contains(&v) {
                out.push(v);
            }
        }
        out
    }
}

/// `t` as RFC 3339 UTC with nanoseconds (how the EndpointSlice controller writes trigger
/// times).
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, day) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rfc3339_dates() {
        let at = |s: u64, n: u32| rfc3339(UNIX_EPOCH + Duration::new(s, n));
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(at(951_782_400, 5), "2000-02-29T00:00:00.000000005Z");
        assert_eq!(at(1_767_225_599, 0), "2025-12-31T23:59:59.000000000Z");
    }

    #[test]
    fn distinct_picks() {
        let mut rng = Rng::new(7);
        for _ in 0..100 {
            let mut v = rng.distinct(5, 6);
            v.sort();
            v.dedup();
            assert_eq!(v.len(), 5);
            assert!(v.iter().all(|&x| x < 6));
        }
    }
}
