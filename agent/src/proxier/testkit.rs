//! Test clusters for the proxier and sync-loop unit tests: Services written as the API server
//! would send them, fed through the change tracker.

use dataplane::input::Object;
use dataplane::model::Cluster;
use dataplane::tracker::{Kind, Tracker};

use crate::config::{KubeProxyConfiguration, Overrides, Settings};
use crate::nftables::fake::FakeKernel;
use crate::proxier::Syncer;
use crate::proxier::udp::UdpCleanup;

pub const NODE: &str = "node1";

/// Service `svc{i}` (ClusterIP 172.30.0.i and, if `dual`, fd00::i, port 80) with `endpoints`
/// ready endpoints on this node.
pub fn service(i: u8, endpoints: u8, dual: bool) -> String {
    let (ips, families) = if dual {
        (format!("[172.30.0.{i}, \"fd00::{i}\"]"), "[IPv4, IPv6]")
    } else {
        (format!("[172.30.0.{i}]"), "[IPv4]")
    };
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: svc{i}, namespace: ns}}\nspec:\n  \
         clusterIP: 172.30.0.{i}\n  clusterIPs: {ips}\n  ipFamilies: {families}\n  \
         ports: [{{name: p, port: 80, protocol: TCP}}]\n"
    );
    let families: &[&str] = if dual { &["IPv4", "IPv6"] } else { &["IPv4"] };
    for family in families {
        yaml.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: svc{i}-{fam}, \
             namespace: ns, labels: {{kubernetes.io/service-name: svc{i}}}}}\naddressType: {family}\n\
             ports: [{{name: p, port: 8080, protocol: TCP}}]\nendpoints:\n",
            fam = family.to_lowercase()
        ));
        for e in 1..=endpoints {
            let addr = if *family == "IPv4" {
                format!("10.1.{i}.{e}")
            } else {
                format!("\"fd01::{i}:{e}\"")
            };
            yaml.push_str(&format!(
                "- {{addresses: [{addr}], conditions: {{ready: true}}, nodeName: {NODE}}}\n"
            ));
        }
    }
    yaml
}

/// Service `big{i}` (ClusterIP 172.31.x.y, port 80, IPv4 only) with `endpoints` ready
/// endpoints on this node: for clusters of thousands of Services.
pub fn numbered_service(i: u16, endpoints: u8) -> String {
    let [hi, lo] = i.to_be_bytes();
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: big{i}, namespace: ns}}\nspec:\n  \
         clusterIP: 172.31.{hi}.{lo}\n  ports: [{{name: p, port: 80, protocol: TCP}}]\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: big{i}-a, \
         namespace: ns, labels: {{kubernetes.io/service-name: big{i}}}}}\naddressType: IPv4\n\
         ports: [{{name: p, port: 8080, protocol: TCP}}]\nendpoints:\n"
    );
    for e in 1..=endpoints {
        yaml.push_str(&format!(
            "- {{addresses: [10.{}.{lo}.{e}], conditions: {{ready: true}}, nodeName: {NODE}}}\n",
            100 + hi
        ));
    }
    yaml
}

/// Applies the objects of `yaml` to the tracker.
pub fn apply(tracker: &mut Tracker, yaml: &str) {
    let mut skipped = Vec::new();
    dataplane::input::for_each_object(yaml, &mut skipped, |o| {
        let invalid = match &o {
            Object::Service(o) => tracker.apply_service(o),
            Object::Slice(o) => tracker.apply_slice(o),
            Object::Node(o) => tracker.apply_node(o),
            Object::ServiceCidr(o) => tracker.apply_service_cidr(o),
        };
        assert!(invalid.is_none(), "{invalid:?}\n{yaml}");
    })
    .expect("valid YAML");
    assert!(skipped.is_empty(), "{skipped:?}\n{yaml}");
}

/// The initial lists begin (objects applied after this are listed).
pub fn begin_lists(tracker: &mut Tracker) {
    for kind in Kind::ALL {
        tracker.begin_list(kind);
    }
}

/// The initial lists are complete.
pub fn end_lists(tracker: &mut Tracker) {
    for kind in Kind::ALL {
        tracker.end_list(kind);
    }
}

/// A cluster of the Services `ids` (one endpoint each, dual-stack).
pub fn cluster(ids: impl IntoIterator<Item = u8>) -> Cluster {
    let mut t = Tracker::new(NODE, "");
    for i in ids {
        apply(&mut t, &service(i, 1, true));
    }
    t.cluster().clone()
}

/// The agent's settings for `minSyncPeriod` and `syncPeriod`.
pub fn settings(min_sync_period: &str, sync_period: &str) -> Settings {
    let text = format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         hostnameOverride: {NODE}\nminSyncPeriod: {min_sync_period}\nsyncPeriod: {sync_period}\n\
         clusterCIDR: 10.0.0.0/8\n"
    );
    let file = KubeProxyConfiguration::parse(&text).expect("valid configuration");
    Settings::resolve(&file, &Overrides::default()).expect("valid settings")
}

/// An nftables syncer on `fake` for both families, without conntrack.
pub fn fake_syncer(fake: &FakeKernel) -> Syncer {
    Syncer::nftables(|family| (fake.clone(), UdpCleanup::new(family, None)))
}
