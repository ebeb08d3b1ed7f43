//! What the sync loop gives the proxiers to build ahead of the first sync while the initial
//! lists arrive (see [`crate::proxier::Proxier::prepare`]): the cluster listed so far, but for
//! the Services none of whose EndpointSlices has arrived yet. Services and EndpointSlices are
//! listed side by side and the slices, larger, come later: a Service built without its
//! endpoints would be built again when they arrive. Held back, it is built once, when its first
//! slice arrives or by the first sync (a Service without endpoints).
//!
//! Each call lets at most [`ADMIT_AT_MOST`] Services in (or out): the build ahead runs at the
//! lowest priority (see [`crate::priority`]), and a short step keeps the first sync from
//! waiting long for one that a busy CPU slowed down. What is left over is built by the first
//! sync.

use std::collections::BTreeSet;

use dataplane::model::{Cluster, ObjectName};

/// Services let into (or out of) the cluster built ahead per call.
pub const ADMIT_AT_MOST: usize = 1000;

#[derive(Debug, Default)]
pub struct Ahead {
    /// The tracker's cluster at the last call.
    last: Cluster,
    /// The cluster built ahead: `last`'s slices, and its Services but for those held back
    /// and those still `pending`.
    ready: Cluster,
    /// Services that changed in the tracker and are not brought up to date in `ready` yet.
    pending: BTreeSet<ObjectName>,
}

impl Ahead {
    /// The part of `now` (the tracker's cluster) to build ahead. O(what changed since the last
    /// call).
    pub fn cluster(&mut self, now: &Cluster) -> Cluster {
        self.pending.extend(self.last.changed_services(now));
        for _ in 0..ADMIT_AT_MOST {
            let Some(name) = self.pending.pop_first() else {
                break;
            };
            match now.services.get(&name) {
                Some(svc) if now.slices_of(&name).next().is_some() => {
                    self.ready.services.insert(name, svc.clone());
                }
                _ => {
                    self.ready.services.remove(&name);
                }
            }
        }
        self.ready.slices = now.slices.clone();
        self.ready.node = now.node.clone();
        self.ready.service_cidrs = now.service_cidrs.clone();
        self.last = now.clone();
        self.ready.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::model::{EndpointSlice, Service, ServiceType};
    use dataplane::net::Family;

    fn service(name: &str) -> Service {
        Service {
            name: ObjectName::new("ns", name),
            service_type: ServiceType::ClusterIp,
            cluster_ips: vec![format!("10.0.0.{}", name.len()).parse().unwrap()],
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            load_balancer_source_ranges: Vec::new(),
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
            affinity_timeout: None,
            ports: Vec::new(),
            creation_timestamp: None,
        }
    }

    fn slice(name: &str, service: &str) -> EndpointSlice {
        EndpointSlice {
            name: ObjectName::new("ns", name),
            service: ObjectName::new("ns", service),
            family: Family::V4,
            ports: Vec::new(),
            endpoints: Vec::new(),
            trigger_time: None,
        }
    }

    fn names(c: &Cluster) -> Vec<String> {
        c.services.keys().map(|n| n.name.to_string()).collect()
    }

    #[test]
    fn services_wait_for_their_first_slice() {
        let mut ahead = Ahead::default();
        let mut now = Cluster::default();
        for name in ["a", "b", "c"] {
            now.services
                .insert(ObjectName::new("ns", name), service(name));
        }
        now.slices
            .insert(ObjectName::new("ns", "a-1"), slice("a-1", "a"));
        assert_eq!(names(&ahead.cluster(&now)), ["a"]);
        // b's slice arrives, a second one for a, and one for a Service not listed yet.
        now.slices
            .insert(ObjectName::new("ns", "b-1"), slice("b-1", "b"));
        now.slices
            .insert(ObjectName::new("ns", "a-2"), slice("a-2", "a"));
        now.slices
            .insert(ObjectName::new("ns", "d-1"), slice("d-1", "d"));
        let ready = ahead.cluster(&now);
        assert_eq!(names(&ready), ["a", "b"]);
        assert_eq!(ready.slices, now.slices);
        // d arrives after its slice; a is deleted; b loses its slice.
        now.services
            .insert(ObjectName::new("ns", "d"), service("d"));
        now.services.remove(&ObjectName::new("ns", "a"));
        now.slices.remove(&ObjectName::new("ns", "b-1"));
        assert_eq!(names(&ahead.cluster(&now)), ["d"]);
        // Nothing changed: the same.
        assert_eq!(names(&ahead.cluster(&now)), ["d"]);
    }

    #[test]
    fn services_are_let_in_a_step_at_a_time() {
        let mut ahead = Ahead::default();
        let mut now = Cluster::default();
        let n = ADMIT_AT_MOST + 10;
        for i in 0..n {
            let name = format!("s{i:05}");
            now.services
                .insert(ObjectName::new("ns", &name), service(&name));
            let slice_name = format!("{name}-1");
            now.slices.insert(
                ObjectName::new("ns", &slice_name),
                slice(&slice_name, &name),
            );
        }
        assert_eq!(ahead.cluster(&now).services.len(), ADMIT_AT_MOST);
        assert_eq!(ahead.cluster(&now).services, now.services);
    }
}
