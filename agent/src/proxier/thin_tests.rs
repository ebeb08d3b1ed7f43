//! The committed state is thin (no elements): partial syncs are planned from what the desired
//! table's update recorded. Property: over random clusters and random change sequences, that
//! delta planning, scoped planning against the table read back, and a full plan against the
//! table read back leave the fake kernel in the same state, which is the desired table, also
//! after set resizes and a node-wide change (both plan the whole table from the thin state), and
//! a restarted agent finds nothing to change.

use std::collections::{BTreeMap, BTreeSet};

use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::BuildConfig;
use dataplane::nft::desired::{Before, Desired, Updated};
use dataplane::nft::plan::{plan, plan_cleanup, plan_cleanup_scope, plan_scope};
use dataplane::nft::render;
use dataplane::nft::ruleset::Family;
use dataplane::tracker::{Kind, Tracker};
use proptest::prelude::*;

use super::testkit::{self, fake_syncer};
use super::{ChangedServices, Syncer};
use crate::nftables::fake::FakeKernel;
use crate::nftables::kernel::NftKernel;

/// One Service `svc{id}`: ClusterIP 172.30.0.`ip` (a small pool, so that Services conflict),
/// endpoints 10.1.0.e from a pool every Service draws from (so that they share endpoints and
/// their `hairpin-endpoints` elements), on both sides of the 16-endpoint lists and of the flat
/// path's classes, with or without session affinity and a NodePort.
#[derive(Clone, Debug)]
struct Spec {
    ip: u8,
    port: u16,
    endpoints: BTreeSet<u8>,
    affinity: bool,
    node_port: bool,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        1u8..6,
        prop_oneof![Just(80u16), Just(53u16)],
        // Up to 120 distinct endpoints: `hairpin-endpoints` outgrows its smallest size (more
        // than 72 elements), which makes an update plan the whole table. Up to 69 per Service:
        // the shared lists and the flat path's classes 5, 6 and 7 (16 / 17, 32 / 33, 64 / 65).
        prop::collection::btree_set(1u8..=120, 0..70),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.2),
    )
        .prop_map(|(ip, port, endpoints, affinity, node_port)| Spec {
            ip,
            port,
            endpoints,
            affinity,
            node_port,
        })
}

fn yaml(id: u8, s: &Spec) -> String {
    let affinity = if s.affinity {
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n"
    } else {
        ""
    };
    let (kind, node_port) = if s.node_port {
        ("NodePort", format!(", nodePort: {}", 30000 + u16::from(id)))
    } else {
        ("ClusterIP", String::new())
    };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: svc{id}, namespace: ns}}\nspec:\n  \
         type: {kind}\n  clusterIP: 172.30.0.{ip}\n  clusterIPs: [172.30.0.{ip}]\n{affinity}  \
         ports: [{{name: p, port: {port}, protocol: TCP{node_port}}}]\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: svc{id}-a, \
         namespace: ns, labels: {{kubernetes.io/service-name: svc{id}}}}}\naddressType: IPv4\n\
         ports: [{{name: p, port: 8080, protocol: TCP}}]\nendpoints:",
        ip = s.ip,
        port = s.port,
    );
    y.push_str(if s.endpoints.is_empty() {
        " []\n"
    } else {
        "\n"
    });
    for e in &s.endpoints {
        y.push_str(&format!(
            "- {{addresses: [10.1.0.{e}], conditions: {{ready: true}}, nodeName: {}}}\n",
            testkit::NODE
        ));
    }
    y
}

/// Applies `spec` (or the deletion of the Service) to the tracker.
fn set(tracker: &mut Tracker, id: u8, spec: Option<&Spec>) {
    match spec {
        Some(s) => testkit::apply(tracker, &yaml(id, s)),
        None => {
            let name = ObjectName::new("ns", &format!("svc{id}"));
            tracker.delete(Kind::Service, &name);
            tracker.delete(
                Kind::EndpointSlice,
                &ObjectName::new("ns", &format!("svc{id}-a")),
            );
        }
    }
}

fn config() -> BuildConfig {
    testkit::settings("1s", "30s").build
}

/// Syncs IPv4 only, as a partial (`full` false) or full sync after `changed` changed.
fn sync(syncer: &mut Syncer, c: &Cluster, changed: &BTreeSet<ObjectName>, full: bool) -> usize {
    sync_with(syncer, c, &config(), changed, full)
}

fn sync_with(
    syncer: &mut Syncer,
    c: &Cluster,
    config: &BuildConfig,
    changed: &BTreeSet<ObjectName>,
    full: bool,
) -> usize {
    let families = BTreeMap::from([(Family::V4, full)]);
    let mut reports =
        syncer.sync_families(c, config, &families, ChangedServices::Services(changed));
    let report = reports.remove(&Family::V4).expect("IPv4 synced");
    report.expect("the sync succeeds").ops
}

/// Scoped planning against the table read back from `kernel` (what the agent did before its
/// committed state was thin), applied to it.
fn scoped_from_read_back(
    kernel: &mut FakeKernel,
    desired: &mut Desired,
    c: &Cluster,
    config: &BuildConfig,
    names: &BTreeSet<ObjectName>,
) {
    let read = kernel.read_table(Family::V4).expect("readable");
    let updated = desired.update(c, config, names);
    let table = desired.table();
    let (tx, scope) = match (&read, updated) {
        (Some(read), Updated::Scope(scope)) => (plan_scope(read, table, &scope), Some(scope)),
        _ => (plan(read.as_ref(), &Before::Nothing, table), None),
    };
    kernel.apply(&tx).expect("the scoped plan commits");
    let after = kernel
        .read_table(Family::V4)
        .expect("readable")
        .expect("a table");
    let cleanup = match &scope {
        Some(scope) => plan_cleanup_scope(&after, table, scope),
        None => plan_cleanup(&after, table),
    };
    kernel.apply(&cleanup).expect("the cleanup commits");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn delta_scoped_and_full_plans_leave_the_kernel_alike(
        start in prop::collection::btree_map(1u8..9, spec(), 0..7),
        steps in prop::collection::vec(
            prop::collection::vec((1u8..9, prop::option::weighted(0.8, spec())), 1..4),
            1..6,
        ),
    ) {
        let mut tracker = Tracker::new(testkit::NODE, "");
        for (id, s) in &start {
            set(&mut tracker, *id, Some(s));
        }
        let c = tracker.cluster().clone();
        let all: BTreeSet<ObjectName> = c.services.keys().cloned().collect();
        // (a) the agent's partial syncs: planned from the update's delta, thin state.
        let (delta_fake, full_fake, scoped_fake) =
            (FakeKernel::new(), FakeKernel::new(), FakeKernel::new());
        let mut delta = fake_syncer(&delta_fake);
        sync(&mut delta, &c, &all, true);
        // (b) scoped planning against the table read back.
        let mut scoped_kernel = scoped_fake.clone();
        let mut desired = Desired::build(&c, &config(), Family::V4);
        let tx = plan(None, &Before::Nothing, desired.table());
        scoped_kernel.apply(&tx).expect("the cold plan commits");
        // (c) full syncs: a full plan against the table read back.
        let mut full = fake_syncer(&full_fake);
        sync(&mut full, &c, &all, true);
        prop_assert_eq!(delta_fake.render(Family::V4), full_fake.render(Family::V4));

        for step in steps {
            let mut names = BTreeSet::new();
            for (id, s) in &step {
                set(&mut tracker, *id, s.as_ref());
                names.insert(ObjectName::new("ns", &format!("svc{id}")));
            }
            let c = tracker.cluster().clone();
            sync(&mut delta, &c, &names, false);
            scoped_from_read_back(&mut scoped_kernel, &mut desired, &c, &config(), &names);
            sync(&mut full, &c, &names, true);
            let want = render::table_text(desired.table());
            prop_assert_eq!(&delta_fake.render(Family::V4), &want);
            prop_assert_eq!(&scoped_fake.render(Family::V4), &want);
            prop_assert_eq!(&full_fake.render(Family::V4), &want);
        }

        // A node-wide change (masquerade everything) rebuilds the desired table: the partial
        // sync plans it against the previous table's elements.
        let c = tracker.cluster().clone();
        let masquerade_all = BuildConfig { masquerade_all: true, ..config() };
        let none = BTreeSet::new();
        sync_with(&mut delta, &c, &masquerade_all, &none, false);
        scoped_from_read_back(&mut scoped_kernel, &mut desired, &c, &masquerade_all, &none);
        sync_with(&mut full, &c, &masquerade_all, &none, true);
        let want = render::table_text(desired.table());
        prop_assert_eq!(&delta_fake.render(Family::V4), &want);
        prop_assert_eq!(&scoped_fake.render(Family::V4), &want);
        prop_assert_eq!(&full_fake.render(Family::V4), &want);

        // A restarted agent builds the table afresh (adopting the kernel's regions and set
        // sizes) and finds nothing to change.
        let mut restarted = fake_syncer(&delta_fake);
        prop_assert_eq!(sync_with(&mut restarted, &c, &masquerade_all, &all, true), 0);
    }
}
