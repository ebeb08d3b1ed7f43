//! The first sync waits for this node's Node object, as kube-proxy waits for it before it
//! starts: the Node gives the NodePort addresses (`nodePortAddresses: [primary]`), the
//! topology labels and the pod CIDRs. The wait is bounded; after it, the rules are built with
//! the node addresses nftproxy can still find, never with none because the Node is unknown.
//! A specific `bindAddress` is this node's primary IP of its family, as in kube-proxy.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use dataplane::model::{Cluster, Node};
use dataplane::tracker::Tracker;

/// How long the first sync waits for the Node object (kube-proxy polls for it for 30 s).
pub const NODE_WAIT: Duration = Duration::from_secs(30);

/// Whether the first sync may start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Not yet: look again at this time (or when something changes).
    Until(Instant),
    /// The Services and EndpointSlices are listed, and the Node is known or waited for long
    /// enough.
    Open,
    /// The initial lists are not complete.
    Listing,
}

/// The wait for the Node before the first sync, and what stands in for it after the wait.
#[derive(Debug)]
pub struct NodeWait {
    node_name: String,
    /// `None`: no waiting (the input is a file, complete as it is).
    wait: Option<Duration>,
    /// `bindAddress` when it names an address.
    bind_address: Option<IpAddr>,
    /// When the initial lists were first seen complete.
    listed_at: Option<Instant>,
    logged: bool,
    /// After the wait, with the Node still unknown: the node as far as it can be told.
    stand_in: Option<Node>,
    opened: bool,
}

impl NodeWait {
    pub fn new(node_name: &str, wait: Option<Duration>, bind_address: IpAddr) -> NodeWait {
        NodeWait {
            node_name: node_name.to_string(),
            wait,
            bind_address: (!bind_address.is_unspecified()).then_some(bind_address),
            listed_at: None,
            logged: false,
            stand_in: None,
            opened: false,
        }
    }

    /// Whether the first sync may start now; once open, it stays open.
    pub fn gate(&mut self, tracker: &Tracker, now: Instant) -> Gate {
        if self.opened {
            return Gate::Open;
        }
        if !tracker.ready() {
            return Gate::Listing;
        }
        let Some(wait) = self.wait else {
            self.opened = true;
            return Gate::Open;
        };
        if tracker.node_known() {
            if self.logged {
                tracing::info!(node = %self.node_name, "Node object received; starting");
            }
            self.opened = true;
            return Gate::Open;
        }
        let listed_at = *self.listed_at.get_or_insert(now);
        let deadline = listed_at + wait;
        if now < deadline {
            if !self.logged {
                tracing::info!(node = %self.node_name, wait = ?wait, "waiting for this node's Node object before the first sync");
                self.logged = true;
            }
            return Gate::Until(deadline);
        }
        self.opened = true;
        Gate::Open
    }

    /// The wait is over and the Node is still unknown: remember which addresses stand in for
    /// it, best first: `bindAddress` when it names one (kube-proxy's own fallback), else the
    /// NodePort addresses an earlier run programmed from the Node (`kernel`).
    pub fn stand_in(&mut self, kernel: impl FnOnce() -> Vec<IpAddr>) {
        let addresses = match self.bind_address {
            Some(ip) => vec![ip],
            None => kernel(),
        };
        if addresses.is_empty() {
            tracing::warn!(node = %self.node_name, waited = ?self.wait, "the Node object is unknown and no earlier node address was found: NodePorts with nodePortAddresses [primary] are not served until it arrives");
        } else {
            tracing::warn!(node = %self.node_name, waited = ?self.wait, ?addresses, "the Node object is unknown: serving NodePorts on the addresses above until it arrives");
        }
        self.stand_in = Some(Node {
            name: self.node_name.clone(),
            addresses,
            ..Node::default()
        });
    }

    /// Whether [`NodeWait::stand_in`] is still to be decided (the wait ran out without a
    /// Node).
    pub fn needs_stand_in(&self, tracker: &Tracker) -> bool {
        self.opened && self.wait.is_some() && self.stand_in.is_none() && !tracker.node_known()
    }

    /// Completes a snapshot of the cluster: the stand-in when the Node is unknown, and a
    /// specific `bindAddress` first among the node's addresses (its family's primary IP).
    pub fn complete(&self, cluster: &mut Cluster) {
        if cluster.node.is_none() {
            cluster.node = self.stand_in.clone();
        }
        if let (Some(ip), Some(node)) = (self.bind_address, cluster.node.as_mut())
            && node.addresses.first() != Some(&ip)
        {
            node.addresses.retain(|a| *a != ip);
            node.addresses.insert(0, ip);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::tracker::Kind;

    fn listed() -> Tracker {
        let mut t = Tracker::new("n1", "");
        for kind in [Kind::Service, Kind::EndpointSlice] {
            t.begin_list(kind);
            t.end_list(kind);
        }
        t
    }

    fn node(name: &str) -> k8s_openapi::api::core::v1::Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}
        }))
        .unwrap()
    }

    #[test]
    fn waits_for_the_lists_then_for_the_node() {
        let t0 = Instant::now();
        let mut w = NodeWait::new("n1", Some(Duration::from_secs(30)), any());
        assert_eq!(w.gate(&Tracker::new("n1", ""), t0), Gate::Listing);
        let mut t = listed();
        let later = t0 + Duration::from_secs(5);
        assert_eq!(
            w.gate(&t, later),
            Gate::Until(later + Duration::from_secs(30))
        );
        t.apply_node(&node("n1"));
        assert_eq!(w.gate(&t, later), Gate::Open);
        assert!(!w.needs_stand_in(&t));
    }

    #[test]
    fn after_the_wait_an_earlier_address_stands_in() {
        let t0 = Instant::now();
        let mut w = NodeWait::new("n1", Some(Duration::from_secs(30)), any());
        let t = listed();
        assert!(matches!(w.gate(&t, t0), Gate::Until(_)));
        assert_eq!(w.gate(&t, t0 + Duration::from_secs(30)), Gate::Open);
        assert!(w.needs_stand_in(&t));
        let kept: IpAddr = "192.0.2.7".parse().unwrap();
        w.stand_in(|| vec![kept]);
        assert!(!w.needs_stand_in(&t));
        let mut cluster = Cluster::default();
        w.complete(&mut cluster);
        assert_eq!(cluster.node.as_ref().unwrap().addresses, [kept]);
        assert_eq!(cluster.node.as_ref().unwrap().name, "n1");
        // A Node that arrives later is used as it is.
        let mut real = Cluster {
            node: Some(Node {
                name: "n1".into(),
                ..Node::default()
            }),
            ..Cluster::default()
        };
        w.complete(&mut real);
        assert!(real.node.as_ref().unwrap().addresses.is_empty());
    }

    #[test]
    fn bind_address_wins_over_the_kernel() {
        let mut w = NodeWait::new("n1", Some(Duration::ZERO), "198.51.100.4".parse().unwrap());
        let t = listed();
        assert_eq!(w.gate(&t, Instant::now()), Gate::Open);
        w.stand_in(|| panic!("not asked"));
        let mut cluster = Cluster::default();
        w.complete(&mut cluster);
        assert_eq!(
            cluster.node.unwrap().addresses[0].to_string(),
            "198.51.100.4"
        );
    }

    #[test]
    fn bind_address_is_the_primary_ip_of_its_family() {
        let w = NodeWait::new("n1", None, "192.0.2.9".parse().unwrap());
        let mut cluster = Cluster {
            node: Some(Node {
                name: "n1".into(),
                addresses: ["192.0.2.1", "192.0.2.9", "2001:db8::1"]
                    .iter()
                    .map(|a| a.parse().unwrap())
                    .collect(),
                ..Node::default()
            }),
            ..Cluster::default()
        };
        w.complete(&mut cluster);
        let node = cluster.node.unwrap();
        let primary = |f| node.primary_ip(f).unwrap().to_string();
        assert_eq!(primary(dataplane::nft::ruleset::Family::V4), "192.0.2.9");
        assert_eq!(primary(dataplane::nft::ruleset::Family::V6), "2001:db8::1");
        assert_eq!(node.addresses.len(), 3);
    }

    fn any() -> IpAddr {
        "0.0.0.0".parse().unwrap()
    }

    #[test]
    fn files_do_not_wait() {
        let mut w = NodeWait::new("n1", None, any());
        let t = listed();
        assert_eq!(w.gate(&t, Instant::now()), Gate::Open);
        assert!(!w.needs_stand_in(&t));
    }
}
