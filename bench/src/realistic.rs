//! The realistic cluster shape: Services that differ the way a real cluster's do, drawn from a
//! seeded generator (the same seed gives the same cluster, and a smaller cluster is a prefix
//! of a larger one).
//!
//! Per Service `i` (names, ClusterIPs and EndpointSlice names as in the uniform shape):
//! * endpoints, heavy-tailed: 2% none, 43% one, 20% two, 10% three (75% have at most three);
//!   18% 4–16; 6.5% 17–99 and 0.5% 100–999 (both log-uniform); and every Service with
//!   `i % 2000 == 999` 1,000–5,000 (one at 1k Services, 50 at 100k). About 9 endpoints per
//!   Service on average. EndpointSlices hold at most 100 endpoints, as the EndpointSlice
//!   controller writes them;
//! * 5% `sessionAffinity: ClientIP`;
//! * 20% multi-port: 15% two ports (TCP 80, 443), 5% three (and UDP 53);
//! * 30% dual-stack;
//! * 75% ClusterIP, 15% NodePort, 10% LoadBalancer; `externalTrafficPolicy: Local` on 30% of
//!   the NodePort and LoadBalancer Services, `internalTrafficPolicy: Local` on 5% of all;
//! * node ports allocated in order from 30000, one per port (about 31k at 100k Services);
//! * endpoints at consecutive pod IPs from `10.64.0.0` (`fd00:10:64::`), the first endpoint of
//!   every third Service on this node.

use crate::synth::{Kind, Shape, Spec};

/// The seed `--seed` defaults to.
pub const DEFAULT_SEED: u64 = 0x6e66_7470_7278_7920;

/// One Service in this many has 1,000–5,000 endpoints (the one with `i % HUGE_EVERY ==
/// HUGE_EVERY / 2 - 1`, so that a 1k cluster has one).
const HUGE_EVERY: usize = 2000;

/// SplitMix64: a small, well-mixed generator; one stream per Service.
struct Rng(u64);

impl Rng {
    fn for_service(seed: u64, i: usize) -> Rng {
        let mut r = Rng(seed ^ (i as u64).wrapping_mul(0xa076_1d64_78bd_642f));
        r.next();
        r
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    /// Log-uniform integer in `lo..=hi`: as many Services between 10 and 100 endpoints as
    /// between 100 and 1,000.
    fn log_range(&mut self, lo: usize, hi: usize) -> usize {
        let (a, b) = ((lo as f64).ln(), ((hi + 1) as f64).ln());
        ((a + self.unit() * (b - a)).exp() as usize).clamp(lo, hi)
    }
}

/// The endpoint count of Service `i`.
fn endpoint_count(i: usize, rng: &mut Rng) -> usize {
    let u = rng.unit();
    if i % HUGE_EVERY == HUGE_EVERY / 2 - 1 {
        return rng.range(1000, 5000);
    }
    match u {
        u if u < 0.02 => 0,
        u if u < 0.45 => 1,
        u if u < 0.65 => 2,
        u if u < 0.75 => 3,
        u if u < 0.93 => rng.range(4, 16),
        u if u < 0.995 => rng.log_range(17, 99),
        _ => rng.log_range(100, 999),
    }
}

/// The first `n` Services of the realistic shape drawn with `seed`.
pub fn specs(n: usize, seed: u64) -> Vec<Spec> {
    let mut out = Vec::with_capacity(n);
    let mut endpoint_base: u32 = 0;
    let mut next_node_port: u32 = 30000;
    for i in 0..n {
        let mut rng = Rng::for_service(seed, i);
        let endpoints = endpoint_count(i, &mut rng);
        let kind = match rng.unit() {
            u if u < 0.75 => Kind::ClusterIp,
            u if u < 0.90 => Kind::NodePort,
            _ => Kind::LoadBalancer,
        };
        let ports = match rng.unit() {
            u if u < 0.15 => 2,
            u if u < 0.20 => 3,
            _ => 1,
        };
        let dual_stack = rng.unit() < 0.30;
        let affinity = rng.unit() < 0.05;
        let etp_local = kind != Kind::ClusterIp && rng.unit() < 0.30;
        let itp_local = rng.unit() < 0.05;
        // Node ports run out above 65535: a cluster that large would have fewer externally
        // reachable Services; the rest stay ClusterIP.
        let (kind, node_port_base) =
            if kind != Kind::ClusterIp && next_node_port + ports as u32 <= u32::from(u16::MAX) {
                let base = next_node_port as u16;
                next_node_port += ports as u32;
                (kind, Some(base))
            } else {
                (Kind::ClusterIp, None)
            };
        out.push(Spec {
            index: i,
            shape: Shape::Realistic,
            kind,
            dual_stack,
            etp_local: etp_local && kind != Kind::ClusterIp,
            itp_local,
            affinity,
            ports,
            endpoints,
            endpoint_base,
            node_port_base,
            lb_index: i as u32,
        });
        endpoint_base += endpoints as u32;
    }
    out
}

/// A realistic-shape ClusterIP Service beyond the generated ones, for the per-Service-shape
/// measurements: single-stack, one port, `endpoints` endpoints from pod address offset
/// `endpoint_base`, with or without ClientIP affinity.
pub fn probe(index: usize, endpoints: usize, affinity: bool, endpoint_base: u32) -> Spec {
    Spec {
        index,
        shape: Shape::Realistic,
        kind: Kind::ClusterIp,
        dual_stack: false,
        etp_local: false,
        itp_local: false,
        affinity,
        ports: 1,
        endpoints,
        endpoint_base,
        node_port_base: None,
        lb_index: index as u32,
    }
}

/// `probe` made a LoadBalancer of two ports, with node ports from `node_ports`: each of its
/// endpoints is then in six endpoint lists (per port, at the ClusterIP, the load-balancer IP and
/// the NodePort).
pub fn load_balancer(probe: Spec, node_ports: u16) -> Spec {
    Spec {
        kind: Kind::LoadBalancer,
        ports: 2,
        node_port_base: Some(node_ports),
        ..probe
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth;

    #[test]
    fn deterministic_and_nested() {
        let a = specs(3000, DEFAULT_SEED);
        let b = specs(1000, DEFAULT_SEED);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(
                (x.endpoints, x.kind, x.affinity, x.ports, x.dual_stack),
                (y.endpoints, y.kind, y.affinity, y.ports, y.dual_stack)
            );
            assert_eq!(x.node_port_base, y.node_port_base);
        }
        let c = specs(1000, DEFAULT_SEED + 1);
        assert!(a.iter().zip(&c).any(|(x, y)| x.endpoints != y.endpoints));
    }

    #[test]
    fn the_mix_is_the_documented_one() {
        let s = synth::stats_of(&specs(100_000, DEFAULT_SEED));
        let pct = |v: usize| v as f64 * 100.0 / s.services as f64;
        let near = |v: usize, want: f64, tol: f64| {
            let got = pct(v);
            assert!((got - want).abs() <= tol, "{got:.2}% vs {want}%");
        };
        near(s.affinity, 5.0, 0.5);
        near(s.multi_port, 20.0, 0.7);
        near(s.dual_stack, 30.0, 0.8);
        near(s.node_port, 15.0, 0.6);
        near(s.load_balancer, 10.0, 0.5);
        near(s.itp_local, 5.0, 0.5);
        near(s.etp_local, 7.5, 0.5);
        // Most Services have 1-3 endpoints, a tail has hundreds, 50 have 1,000-5,000.
        near(s.by_endpoints[1], 73.0, 1.0);
        assert!(s.by_endpoints[4] > 300, "{:?}", s.by_endpoints);
        assert_eq!(s.by_endpoints[5], 50);
        assert!(s.endpoints_max > 4000 && s.endpoints_max <= 5000);
        let mean = s.endpoints_v4 as f64 / s.services as f64;
        assert!((7.0..12.0).contains(&mean), "{mean}");
    }

    #[test]
    fn converts_with_the_agents_code() {
        let specs = specs(1000, DEFAULT_SEED);
        let cluster = synth::to_cluster(&synth::objects_of(&specs)).expect("converts");
        assert_eq!(cluster.services.len(), 1000);
        let huge = &specs[999];
        assert!(huge.endpoints >= 1000);
        let slices = cluster.slices_of(&huge.object_name()).count();
        let families = 1 + usize::from(huge.dual_stack);
        assert_eq!(
            slices,
            families * huge.endpoints.div_ceil(synth::REALISTIC_SLICE_MAX)
        );
        let with_affinity = cluster
            .services
            .values()
            .filter(|s| s.affinity_timeout.is_some())
            .count();
        assert_eq!(with_affinity, specs.iter().filter(|s| s.affinity).count());
    }
}
