//! What one endpoint change, and a whole Service deleted and added again, cost the agent's
//! pure part of a partial sync: `Desired::update` for the changed Service, then `plan_scope`
//! for what it touched, on a cluster of many small Services plus one large Service per
//! endpoint count measured.
//!
//! ```sh
//! cargo run --release -p nftproxy-dataplane --example desired_update -- [SERVICES] [REPS] [SHAPE] [SIZES]
//! ```
//!
//! SHAPE is the large Services': `nodeport` (default: one port, a ClusterIP and a NodePort, so
//! two lists per endpoint) or `lb` (a LoadBalancer with two ports, each at its ClusterIP, its
//! load-balancer IP and its NodePort: six lists per endpoint). SIZES lists the large Services'
//! endpoint counts, comma-separated (default `1,20,200,1000,5000`), say one count to profile it.
//!
//! Prints, per endpoint count, the median and worst of `REPS` Service deletions and additions
//! and endpoint additions and removals (microseconds), and how many elements an endpoint
//! change touched.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use nftproxy_dataplane::model::{
    Cluster, Endpoint, EndpointPort, EndpointSlice, Hints, ObjectName, Service, ServicePort,
    ServiceType, Site,
};
use nftproxy_dataplane::nft::build::{BuildConfig, LocalDetector};
use nftproxy_dataplane::nft::desired::{Desired, Updated};
use nftproxy_dataplane::nft::plan::plan_scope;
use nftproxy_dataplane::nft::ruleset::{Family, Proto};
use nftproxy_dataplane::nft::state::TableState;

/// The endpoint counts of the large Services (the bench's probes) unless SIZES is given.
const SIZES: [u32; 5] = [1, 20, 200, 1000, 5000];

fn endpoint(n: u32) -> Endpoint {
    Endpoint {
        addr: IpAddr::from(std::net::Ipv4Addr::from(
            u32::from_be_bytes([10, 64, 0, 0]) + n,
        )),
        ready: true,
        serving: true,
        terminating: false,
        site: Site::new(Some("other"), Hints::default()),
    }
}

/// The shape of a Service the example adds.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    ClusterIp,
    NodePort,
    /// Two ports, a load-balancer IP (10.96.0.0 + i) and node ports.
    LoadBalancer,
}

/// Adds Service `svc{i}` (ClusterIP 172.16.0.0 + i) of `shape` with one slice holding
/// `endpoints`.
fn add_service(c: &mut Cluster, i: u32, endpoints: Vec<Endpoint>, shape: Shape) {
    let name = ObjectName::new("ns", &format!("svc{i}"));
    let ports: Vec<ServicePort> = (0..if shape == Shape::LoadBalancer { 2 } else { 1 })
        .map(|p| ServicePort {
            name: format!("p{p}").into(),
            protocol: Proto::Tcp,
            port: 80 + p,
            // Distinct (of two Services claiming one node port only the older has it): the
            // small Services' from 20000, the large ones' two each from 10000.
            node_port: (shape != Shape::ClusterIp).then(|| {
                let port = if i < 40_000 {
                    20000 + i
                } else {
                    10000 + 2 * (i - 40_000) + u32::from(p)
                };
                u16::try_from(port).expect("at most 45,000 small Services")
            }),
        })
        .collect();
    let lb_ip = IpAddr::from(std::net::Ipv4Addr::from(
        u32::from_be_bytes([10, 96, 0, 0]) + i,
    ));
    c.services.insert(
        name.clone(),
        Arc::new(Service {
            name: name.clone(),
            service_type: match shape {
                Shape::ClusterIp => ServiceType::ClusterIp,
                Shape::NodePort => ServiceType::NodePort,
                Shape::LoadBalancer => ServiceType::LoadBalancer,
            },
            cluster_ips: vec![IpAddr::from(std::net::Ipv4Addr::from(
                u32::from_be_bytes([172, 16, 0, 0]) + i,
            ))]
            .into(),
            external_ips: vec![].into(),
            load_balancer_ips: if shape == Shape::LoadBalancer {
                vec![lb_ip].into()
            } else {
                vec![].into()
            },
            load_balancer_source_ranges: vec![].into(),
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
            affinity_timeout: None,
            ports: ports.into(),
            creation_timestamp: None,
        }),
    );
    set_endpoints(c, i, endpoints);
}

fn set_endpoints(c: &mut Cluster, i: u32, endpoints: Vec<Endpoint>) {
    let slice = ObjectName::new("ns", &format!("svc{i}-a"));
    c.slices.insert(
        slice.clone(),
        EndpointSlice {
            name: slice,
            service: ObjectName::new("ns", &format!("svc{i}")),
            family: Family::V4,
            ports: (0..2)
                .map(|p| EndpointPort {
                    name: format!("p{p}").into(),
                    protocol: Proto::Tcp,
                    port: 8080 + p,
                })
                .collect(),
            endpoints: endpoints.into(),
            trigger_time: None,
        },
    );
}

/// Updates `desired` for Service `name` and plans the change against `state`, recording the
/// microseconds of each in `times`; returns the elements the change touched, or None when a
/// set outgrew its size (the whole table is planned then, which is not measured).
fn sync(
    desired: &mut Desired,
    state: &mut TableState,
    c: &Cluster,
    config: &BuildConfig,
    name: &ObjectName,
    times: &mut [Vec<f64>; 2],
) -> Option<usize> {
    let t = Instant::now();
    let updated = desired.update(c, config, [name]);
    let update = t.elapsed();
    let Updated::Scope(scope) = updated else {
        return None;
    };
    let t = Instant::now();
    let tx = plan_scope(state, desired.table(), &scope);
    let plan = t.elapsed();
    state.apply(&tx);
    times[0].push(update.as_secs_f64() * 1e6);
    times[1].push(plan.as_secs_f64() * 1e6);
    Some(scope.elements.values().map(|k| k.len()).sum())
}

fn micros(samples: &mut [f64]) -> (f64, f64) {
    if samples.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    samples.sort_by(f64::total_cmp);
    (samples[samples.len() / 2], samples[samples.len() - 1])
}

fn main() {
    let mut args = std::env::args().skip(1);
    let services: u32 = args.next().map_or(10_000, |a| a.parse().expect("SERVICES"));
    let reps: usize = args.next().map_or(50, |a| a.parse().expect("REPS"));
    let shape = match args.next().as_deref() {
        None | Some("nodeport") => Shape::NodePort,
        Some("lb") => Shape::LoadBalancer,
        Some(other) => panic!("SHAPE: nodeport or lb, not {other}"),
    };
    let sizes: Vec<u32> = args.next().map_or(SIZES.to_vec(), |a| {
        a.split(',')
            .map(|n| n.parse().expect("SIZES: endpoint counts"))
            .collect()
    });
    let config = BuildConfig {
        node_name: "node".into(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        ..BuildConfig::default()
    };
    let mut c = Cluster::default();
    let mut next_ep = 0u32;
    let mut take = |n: u32| -> Vec<Endpoint> {
        let eps = (next_ep..next_ep + n).map(endpoint).collect();
        next_ep += n;
        eps
    };
    for i in 0..services {
        let small = if i % 5 == 0 {
            Shape::NodePort
        } else {
            Shape::ClusterIp
        };
        add_service(&mut c, i, take(1 + i % 3), small);
    }
    // The large Services: svc{40000 + k}.
    assert!(services <= 40_000, "at most 40,000 small Services");
    let probes: Vec<(u32, u32)> = (40_000..).zip(sizes).collect();
    for &(i, n) in &probes {
        add_service(&mut c, i, take(n), shape);
    }
    let t = Instant::now();
    let mut desired = Desired::build(&c, &config, Family::V4);
    println!(
        "{services} Services + probes: build {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut state = TableState::read_back(desired.table());
    state.settle();
    println!("endpoints  op       update µs (median / max)  plan µs (median / max)  touched");
    for &(i, n) in &probes {
        let name = ObjectName::new("ns", &format!("svc{i}"));
        let base: Vec<Endpoint> = c
            .slices_of(&name)
            .flat_map(|s| s.endpoints.iter())
            .collect();
        let mut times: [[Vec<f64>; 2]; 2] = Default::default();
        let mut touched = [0usize; 2];
        let mut resized = 0;
        for rep in 0..reps {
            // Add one endpoint, then remove one from the middle (another each time).
            let mut eps = base.clone();
            eps.push(endpoint(next_ep + rep as u32));
            let mut fewer = eps.clone();
            fewer.remove(fewer.len() / 2);
            for (op, eps) in [eps, fewer].into_iter().enumerate() {
                set_endpoints(&mut c, i, eps);
                match sync(&mut desired, &mut state, &c, &config, &name, &mut times[op]) {
                    Some(n) => touched[op] = n,
                    None => resized += 1,
                }
            }
            set_endpoints(&mut c, i, base.clone());
            desired.update(&c, &config, [&name]);
        }
        // The whole Service deleted, then added again.
        let svc = c.services.get(&name).cloned().expect("probe Service");
        let slice = ObjectName::new("ns", &format!("svc{i}-a"));
        let mut whole: [[Vec<f64>; 2]; 2] = Default::default();
        for _ in 0..reps {
            for (op, times) in whole.iter_mut().enumerate() {
                if op == 0 {
                    c.services.remove(&name);
                    c.slices.remove(&slice);
                } else {
                    c.services.insert(name.clone(), svc.clone());
                    set_endpoints(&mut c, i, base.clone());
                }
                if sync(&mut desired, &mut state, &c, &config, &name, times).is_none() {
                    resized += 1;
                }
            }
        }
        if resized > 0 {
            println!("{n:>9}  ({resized} changes resized a set: not measured)");
        }
        for (op, label) in ["Service deleted", "Service added"].into_iter().enumerate() {
            let (um, ux) = micros(&mut whole[op][0]);
            let (pm, px) = micros(&mut whole[op][1]);
            println!("{n:>9}  {label:<15}  {um:>10.1} / {ux:<10.1}      {pm:>8.1} / {px:<10.1}");
        }
        for (op, label) in ["added", "removed"].into_iter().enumerate() {
            let (um, ux) = micros(&mut times[op][0]);
            let (pm, px) = micros(&mut times[op][1]);
            println!(
                "{n:>9}  {label:<7}  {um:>10.1} / {ux:<10.1}      {pm:>8.1} / {px:<10.1}   {}",
                touched[op]
            );
        }
    }
}
