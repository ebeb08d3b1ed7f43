//! Values that many objects of the model repeat (node names, namespaces, endpoint sites),
//! held once each.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

use super::{EndpointPort, Hints, ServicePort, Site};

/// Values that many objects repeat, one shared allocation each. Values nothing holds any more
/// are swept once the set has doubled, so values that come and go (nodes, namespaces) do not
/// pile up, at O(1) per value.
#[derive(Debug)]
struct Interner<T: ?Sized> {
    values: HashSet<Arc<T>>,
    /// Size after the last sweep.
    swept_at: usize,
}

impl<T: ?Sized> Clone for Interner<T> {
    fn clone(&self) -> Interner<T> {
        Interner {
            values: self.values.clone(),
            swept_at: self.swept_at,
        }
    }
}

impl<T: ?Sized> Default for Interner<T> {
    fn default() -> Interner<T> {
        Interner {
            values: HashSet::new(),
            swept_at: 0,
        }
    }
}

impl<T: ?Sized + Hash + Eq> Interner<T> {
    /// The shared value equal to `key`, made by `make` if there is none.
    fn get<Q>(&mut self, key: &Q, make: impl FnOnce(&Q) -> Arc<T>) -> Arc<T>
    where
        Q: ?Sized + Hash + Eq,
        Arc<T>: std::borrow::Borrow<Q>,
    {
        if let Some(v) = self.values.get(key) {
            return v.clone();
        }
        if self.values.len() >= 2 * self.swept_at + 64 {
            self.values.retain(|v| Arc::strong_count(v) > 1);
            self.swept_at = self.values.len();
        }
        let v = make(key);
        self.values.insert(v.clone());
        v
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.values.len()
    }
}

/// What the objects converted into one model share, one allocation each: names (the node
/// names endpoints refer to, as a cluster has far fewer nodes than endpoints, the namespaces
/// of objects and the names of ports: a string per endpoint or per object was a heap block
/// each), the sites of endpoints, one [`Site`] for each node and set of hints, and the port
/// lists of Services and slices (most workloads serve the same few ports).
#[derive(Clone, Debug, Default)]
pub struct Shared {
    names: Interner<str>,
    sites: Interner<Site>,
    service_ports: Interner<[ServicePort]>,
    endpoint_ports: Interner<[EndpointPort]>,
}

impl Shared {
    /// The shared string for `name`.
    pub fn name(&mut self, name: &str) -> Arc<str> {
        self.names.get(name, |n: &str| Arc::from(n))
    }

    /// The shared site of an endpoint on `node_name` with `hints`; None when it has neither.
    pub fn site(&mut self, node_name: Option<&str>, hints: Hints) -> Option<Arc<Site>> {
        let site = Site {
            node_name: node_name.map(|n| self.name(n)),
            hints,
        };
        (site != Site::default()).then(|| self.sites.get(&site, |s| Arc::new(s.clone())))
    }

    /// The shared list equal to `ports`.
    pub fn service_ports(&mut self, ports: &[ServicePort]) -> Arc<[ServicePort]> {
        self.service_ports
            .get(ports, |p: &[ServicePort]| Arc::from(p))
    }

    /// The shared list equal to `ports`.
    pub fn endpoint_ports(&mut self, ports: &[EndpointPort]) -> Arc<[EndpointPort]> {
        self.endpoint_ports
            .get(ports, |p: &[EndpointPort]| Arc::from(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_shared_and_unused_ones_swept() {
        let mut names = Shared::default();
        let a = names.name("node-a");
        assert!(Arc::ptr_eq(&a, &names.name("node-a")));
        // Nodes that come and go do not pile up: names nobody holds are dropped.
        for i in 0..10_000 {
            names.name(&format!("gone-{i}"));
        }
        assert!(names.names.len() < 200, "{} names kept", names.names.len());
        assert!(Arc::ptr_eq(&a, &names.name("node-a")));
    }

    #[test]
    fn equal_port_lists_are_shared() {
        let mut shared = Shared::default();
        let port = |name: &str, port: u16| EndpointPort {
            name: name.into(),
            protocol: crate::net::Proto::Tcp,
            port,
        };
        let a = shared.endpoint_ports(&[port("http", 8080), port("metrics", 9090)]);
        let b = shared.endpoint_ports(&[port("http", 8080), port("metrics", 9090)]);
        assert!(Arc::ptr_eq(&a, &b));
        let c = shared.endpoint_ports(&[port("http", 8080)]);
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(&*c, &[port("http", 8080)]);

        let service_port = |node_port| ServicePort {
            name: "http".into(),
            protocol: crate::net::Proto::Tcp,
            port: 80,
            node_port,
        };
        let a = shared.service_ports(&[service_port(None)]);
        assert!(Arc::ptr_eq(
            &a,
            &shared.service_ports(&[service_port(None)])
        ));
        // A NodePort makes a list of its own.
        let b = shared.service_ports(&[service_port(Some(30080))]);
        assert!(!Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn sites_are_shared_and_unused_ones_swept() {
        let mut sites = Shared::default();
        let zone = |z: &str| Hints {
            zones: [z.to_string()].into(),
            nodes: [].into(),
        };
        let a = sites.site(Some("node-a"), Hints::default()).unwrap();
        let a_hinted = sites.site(Some("node-a"), zone("z1")).unwrap();
        assert!(Arc::ptr_eq(
            &a,
            &sites.site(Some("node-a"), Hints::default()).unwrap()
        ));
        assert!(Arc::ptr_eq(
            &a_hinted,
            &sites.site(Some("node-a"), zone("z1")).unwrap()
        ));
        assert!(!Arc::ptr_eq(&a, &a_hinted));
        // Both name the node with one string.
        let (n, m) = (
            a.node_name.as_ref().unwrap(),
            a_hinted.node_name.as_ref().unwrap(),
        );
        assert!(Arc::ptr_eq(n, m));
        assert_eq!(sites.site(None, Hints::default()), None);
        assert_eq!(sites.site(None, zone("z1")).unwrap().node_name, None);
        for i in 0..10_000 {
            sites.site(Some(&format!("gone-{i}")), Hints::default());
        }
        assert!(sites.sites.len() < 200, "{} sites kept", sites.sites.len());
        assert!(Arc::ptr_eq(
            &a,
            &sites.site(Some("node-a"), Hints::default()).unwrap()
        ));
    }
}
