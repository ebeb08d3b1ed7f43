//! Which endpoints a Service port uses: kube-proxy's `CategorizeEndpoints`, ready endpoints first,
//! serving-terminating ones as fallback, topology hints all-or-nothing, traffic policies.

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::model::Site;

/// One endpoint of one Service port, as the proxy sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortEndpoint<'a> {
    pub addr: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub placement: Placement,
    /// The endpoint's in the model (its hints are read here).
    pub site: Option<&'a Site>,
}

/// Where an endpoint runs, as its EndpointSlice says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// On this node.
    Here,
    /// On another node: a `nodeName` that is not this node's.
    Elsewhere,
    /// No `nodeName`, or an agent without a node name: it may be here.
    Unknown,
}

impl Placement {
    /// `node_name` of an endpoint, seen from the node `this` ("" when the agent has no name).
    pub fn of(node_name: Option<&str>, this: &str) -> Placement {
        match node_name {
            _ if this.is_empty() => Placement::Unknown,
            Some(n) if n == this => Placement::Here,
            Some(_) => Placement::Elsewhere,
            None => Placement::Unknown,
        }
    }
}

impl PortEndpoint<'_> {
    /// On this node.
    pub fn local(&self) -> bool {
        self.placement == Placement::Here
    }

    fn serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    /// `hints.forZones`: the zones whose traffic should go to this endpoint.
    pub fn zone_hints(&self) -> &[String] {
        self.site.map_or(&[], |s| &s.hints.zones)
    }

    /// `hints.forNodes`: the nodes whose traffic should go to this endpoint.
    pub fn node_hints(&self) -> &[String] {
        self.site.map_or(&[], |s| &s.hints.nodes)
    }
}

/// What a Service port needs the endpoint lists for.
#[derive(Clone, Copy, Debug)]
pub struct Usage {
    pub uses_cluster: bool,
    pub uses_local: bool,
}

impl Usage {
    pub fn new(internal_local: bool, external_local: bool, externally_accessible: bool) -> Usage {
        Usage {
            // eTP=Local still needs the cluster endpoints: pod and host sources short-circuit.
            uses_cluster: !internal_local || externally_accessible,
            uses_local: internal_local || (external_local && externally_accessible),
        }
    }
}

/// Where this node sits, for topology hints.
#[derive(Clone, Debug, Default)]
pub struct NodeTopology<'a> {
    pub node_name: &'a str,
    pub zone: Option<&'a str>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Categorized<'a> {
    /// Endpoints for Cluster-policy traffic.
    pub cluster: Vec<PortEndpoint<'a>>,
    /// Endpoints for Local-policy traffic.
    pub local: Vec<PortEndpoint<'a>>,
    reachable: Reachable<'a>,
    /// Some endpoint anywhere is usable (ready, or serving while terminating).
    pub has_any: bool,
}

/// Which list holds every endpoint any rule may send traffic to. Mostly one of the two does:
/// a copy would cost a large Service's every sync a pass over its endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Reachable<'a> {
    #[default]
    Cluster,
    Local,
    /// Neither: cluster ∪ local.
    Both(Vec<PortEndpoint<'a>>),
}

impl<'a> Categorized<'a> {
    /// Every endpoint any rule may send traffic to (cluster ∪ local), in a stable order.
    pub fn all_reachable(&self) -> &[PortEndpoint<'a>] {
        match &self.reachable {
            Reachable::Cluster => &self.cluster,
            Reachable::Local => &self.local,
            Reachable::Both(all) => all,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TopologyMode {
    None,
    SameNode,
    SameZone,
}

fn topology_mode(endpoints: &[PortEndpoint<'_>], topo: &NodeTopology<'_>) -> TopologyMode {
    let ready = || endpoints.iter().filter(|e| e.ready);
    if ready().next().is_none() {
        return TopologyMode::None;
    }
    if ready().all(|e| !e.node_hints().is_empty())
        && ready().any(|e| e.node_hints().iter().any(|n| n == topo.node_name))
    {
        return TopologyMode::SameNode;
    }
    if let Some(zone) = topo.zone
        && ready().all(|e| !e.zone_hints().is_empty())
        && ready().any(|e| e.zone_hints().iter().any(|z| z == zone))
    {
        return TopologyMode::SameZone;
    }
    TopologyMode::None
}

fn available(e: &PortEndpoint<'_>, mode: TopologyMode, topo: &NodeTopology<'_>) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::SameNode => e.node_hints().iter().any(|n| n == topo.node_name),
        TopologyMode::SameZone => topo
            .zone
            .is_some_and(|zone| e.zone_hints().iter().any(|z| z == zone)),
    }
}

/// kube-proxy's `CategorizeEndpoints`. Takes the endpoints by value: when every one of them
/// serves Cluster-policy traffic (the usual case), they become that list without a copy.
pub fn categorize<'a>(
    endpoints: Vec<PortEndpoint<'a>>,
    usage: Usage,
    topo: &NodeTopology<'_>,
) -> Categorized<'a> {
    let mut out = Categorized::default();
    if endpoints.is_empty() {
        return out;
    }
    let mut use_serving_terminating = false;
    if usage.uses_local {
        let mut has_local_ready = false;
        let mut has_local_serving_terminating = false;
        for e in &endpoints {
            if e.ready {
                out.has_any = true;
                has_local_ready |= e.local();
            } else if e.serving_terminating() {
                out.has_any = true;
                has_local_serving_terminating |= e.local();
            }
        }
        if has_local_ready {
            out.local = endpoints
                .iter()
                .filter(|e| e.local() && e.ready)
                .copied()
                .collect();
        } else if has_local_serving_terminating {
            out.local = endpoints
                .iter()
                .filter(|e| e.local() && e.serving_terminating())
                .copied()
                .collect();
            use_serving_terminating = true;
        }
    }
    let mut mode = TopologyMode::None;
    if usage.uses_cluster {
        mode = topology_mode(&endpoints, topo);
        let usable = |e: &PortEndpoint<'_>| e.ready && available(e, mode, topo);
        out.cluster = if endpoints.iter().all(usable) {
            endpoints
        } else {
            let ready: Vec<PortEndpoint<'a>> =
                endpoints.iter().filter(|e| usable(e)).copied().collect();
            if ready.is_empty() {
                endpoints
                    .into_iter()
                    .filter(PortEndpoint::serving_terminating)
                    .collect()
            } else {
                ready
            }
        };
        // With the local list, `has_any` counts every node's endpoints already.
        out.has_any |= !out.cluster.is_empty();
    }
    out.reachable = if !usage.uses_local {
        Reachable::Cluster
    } else if !usage.uses_cluster {
        Reachable::Local
    } else if mode == TopologyMode::None && !use_serving_terminating {
        // The local list is then the cluster list's local part.
        Reachable::Cluster
    } else {
        let mut seen = BTreeSet::new();
        Reachable::Both(
            out.cluster
                .iter()
                .chain(out.local.iter())
                .filter(|e| seen.insert((e.addr, e.port)))
                .copied()
                .collect(),
        )
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Hints;

    fn ep(
        last: u8,
        ready: bool,
        serving: bool,
        terminating: bool,
        local: bool,
    ) -> PortEndpoint<'static> {
        PortEndpoint {
            addr: IpAddr::from([10, 0, 1, last]),
            port: 80,
            ready,
            serving,
            terminating,
            placement: if local {
                Placement::Here
            } else {
                Placement::Elsewhere
            },
            site: None,
        }
    }

    fn addrs(v: &[PortEndpoint]) -> Vec<u8> {
        v.iter()
            .map(|e| match e.addr {
                IpAddr::V4(a) => a.octets()[3],
                IpAddr::V6(_) => 0,
            })
            .collect()
    }

    const TOPO: NodeTopology<'static> = NodeTopology {
        node_name: "test-node",
        zone: Some("zone-a"),
    };

    #[test]
    fn etp_local_ready_and_terminating() {
        // Reference §7.7 "ready endpoints exist".
        let eps = vec![
            ep(1, true, true, false, true),
            ep(2, true, true, false, true),
            ep(3, false, true, true, true),
            ep(4, false, false, true, true),
            ep(5, true, true, false, false),
        ];
        let c = categorize(eps, Usage::new(false, true, true), &TOPO);
        assert_eq!(addrs(&c.cluster), vec![1, 2, 5]);
        assert_eq!(addrs(&c.local), vec![1, 2]);
        assert!(c.has_any);
        // "only terminating endpoints exist"
        let eps = vec![
            ep(2, false, true, true, true),
            ep(3, false, true, true, true),
            ep(4, false, false, true, true),
            ep(5, true, true, false, false),
        ];
        let c = categorize(eps, Usage::new(false, true, true), &TOPO);
        assert_eq!(addrs(&c.cluster), vec![5]);
        assert_eq!(addrs(&c.local), vec![2, 3]);
        assert_eq!(addrs(c.all_reachable()), vec![5, 2, 3]);
        // "terminating endpoints on remote node"
        let eps = vec![ep(5, false, true, true, false)];
        let c = categorize(eps, Usage::new(false, true, true), &TOPO);
        assert_eq!(addrs(&c.cluster), vec![5]);
        assert!(c.local.is_empty());
        // "no usable endpoints"
        let eps = vec![
            ep(5, false, false, true, true),
            ep(6, false, false, true, false),
        ];
        let c = categorize(eps, Usage::new(false, true, true), &TOPO);
        assert!(!c.has_any);
    }

    #[test]
    fn zone_hints_are_all_or_nothing() {
        let mut a = ep(1, true, true, false, false);
        let site_a = Site {
            node_name: None,
            hints: Hints {
                zones: ["zone-a".into()].into(),
                nodes: [].into(),
            },
        };
        a.site = Some(&site_a);
        let mut b = ep(2, true, true, false, false);
        let site_b = Site {
            node_name: None,
            hints: Hints {
                zones: ["zone-b".into()].into(),
                nodes: [].into(),
            },
        };
        b.site = Some(&site_b);
        let c = categorize(vec![a, b], Usage::new(false, false, false), &TOPO);
        assert_eq!(addrs(&c.cluster), vec![1]);
        let unhinted = ep(3, true, true, false, false);
        let c = categorize(vec![a, b, unhinted], Usage::new(false, false, false), &TOPO);
        assert_eq!(addrs(&c.cluster), vec![1, 2, 3]);
    }

    #[test]
    fn internal_local_uses_only_local() {
        let eps = vec![
            ep(1, true, true, false, true),
            ep(2, true, true, false, false),
        ];
        let c = categorize(eps, Usage::new(true, false, false), &TOPO);
        assert!(c.cluster.is_empty());
        assert_eq!(addrs(&c.local), vec![1]);
        assert_eq!(addrs(c.all_reachable()), vec![1]);
        let eps = vec![ep(2, true, true, false, false)];
        let c = categorize(eps, Usage::new(true, false, false), &TOPO);
        assert!(c.has_any && c.local.is_empty());
    }
}
