//! The exact check at the end of the churn: the kernel's tables, read back with the agent's own
//! netlink code, against the tables the agent's own code builds from the API server's final
//! objects. Any difference is a change the agent lost (or something it did wrong).

use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use dataplane::model::Cluster;
use dataplane::nft::desired::{Before, Desired};
use dataplane::nft::plan::{plan, plan_cleanup};
use dataplane::nft::ruleset::Family;
use dataplane::nft::state::TableState;
use dataplane::nft::transaction::Op;
use dataplane::tracker::Tracker;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use nftproxy::config::{KubeProxyConfiguration, Overrides, Settings};
use nftproxy::nftables::Nftables;
use nftproxy::node_wait::NodeWait;
use nftproxy_tests::apiserver::ApiServer;
use serde::Serialize;
use serde_json::Value;

use crate::netns::Netns;

/// How many differing operations are shown.
const SHOW_OPS: usize = 8;

#[derive(Clone, Debug, Default, Serialize)]
pub struct FamilyCheck {
    pub family: &'static str,
    /// The kernel has the family's `nftproxy` table.
    pub kernel_table: bool,
    pub kernel_chains: usize,
    pub kernel_sets: usize,
    pub kernel_elements: usize,
    pub desired_elements: usize,
    /// Operations of `plan(kernel, desired)` and of `plan_cleanup(kernel, desired)`.
    pub ops: usize,
    pub cleanup_ops: usize,
    /// The first differing operations (abbreviated).
    pub first_ops: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Check {
    /// Seconds after the churn stopped.
    pub at_s: f64,
    pub services: usize,
    pub slices: usize,
    /// Endpoints of the model (all slices).
    pub endpoints: usize,
    pub families: Vec<FamilyCheck>,
    /// The same check against a model with one endpoint moved to a pod the kernel has never
    /// seen: must find a difference (the check is not blind).
    pub control_ops: usize,
    pub took_ms: f64,
}

impl Check {
    /// Operations that would still be needed to make the kernel equal the model.
    pub fn pending_ops(&self) -> usize {
        self.families.iter().map(|f| f.ops + f.cleanup_ops).sum()
    }
}

/// The objects of the API server through the agent's own tracker (the conversion the agent's
/// watchers use), completed as the agent's sync loop completes its snapshot.
fn model(api: &ApiServer, settings: &Settings) -> Result<(Tracker, usize)> {
    let mut tracker = Tracker::new(&settings.node_name, "");
    let mut skipped = Vec::new();
    for v in api.list("Service") {
        let s: core::Service = serde_json::from_value(v).context("a Service")?;
        skipped.extend(tracker.apply_service(&s));
    }
    let slices = api.list("EndpointSlice");
    let count = slices.len();
    for v in slices {
        let s: discovery::EndpointSlice = serde_json::from_value(v).context("an EndpointSlice")?;
        skipped.extend(tracker.apply_slice(&s));
    }
    for v in api.list("Node") {
        let n: core::Node = serde_json::from_value(v).context("a Node")?;
        skipped.extend(tracker.apply_node(&n));
    }
    for v in api.list("ServiceCIDR") {
        let c: networking::ServiceCIDR = serde_json::from_value(v).context("a ServiceCIDR")?;
        skipped.extend(tracker.apply_service_cidr(&c));
    }
    if let Some(s) = skipped.first() {
        bail!("{} objects skipped as invalid, e.g. {s}", skipped.len());
    }
    Ok((tracker, count))
}

fn complete(tracker: &Tracker, settings: &Settings) -> Cluster {
    let mut cluster = tracker.cluster().clone();
    NodeWait::new(&settings.node_name, None, settings.bind_address).complete(&mut cluster);
    cluster
}

pub fn settings(config_text: &str) -> Result<Settings> {
    let file = KubeProxyConfiguration::parse(config_text).map_err(|e| anyhow!(e))?;
    Ok(Settings::resolve(&file, &Overrides::default())?)
}

/// Each family's table as read back (`None`: no table).
type KernelTables = Vec<(Family, Option<TableState>)>;

/// What the kernel holds in `ns` (both families), and the namespace's addresses.
fn read_kernel(ns: &Netns) -> Result<(KernelTables, Vec<std::net::IpAddr>)> {
    ns.run_in(|| {
        let mut nft = Nftables::open()?;
        let mut tables = Vec::new();
        for family in Family::ALL {
            // A dump interrupted by a commit of the agent is read again.
            let mut attempt = 0;
            let state = loop {
                match nft.read_table(family) {
                    Ok(s) => break s,
                    Err(e) if attempt < 5 => {
                        eprintln!("nftproxy-soak: reading the {family:?} table: {e}; again");
                        attempt += 1;
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            tables.push((family, state));
        }
        Ok((tables, nftproxy::addresses::local_addresses()))
    })
}

fn abbreviated(op: &Op) -> String {
    let text = match op {
        Op::AddElements { set, elements } => format!(
            "AddElements {{ set: {set:?}, {} elements: {:?} }}",
            elements.len(),
            elements.iter().take(4).collect::<Vec<_>>()
        ),
        Op::DeleteElements { set, keys } => format!(
            "DeleteElements {{ set: {set:?}, {} keys: {:?} }}",
            keys.len(),
            &keys[..keys.len().min(4)]
        ),
        other => format!("{other:?}"),
    };
    if text.len() > 400 {
        format!("{}…", &text[..text.floor_char_boundary(400)])
    } else {
        text
    }
}

fn elements(state: &TableState) -> usize {
    state
        .sets
        .values()
        .filter_map(|s| s.elements.read())
        .map(|e| e.len())
        .sum()
}

/// Reads the kernel and compares it with the model of the API server's objects.
pub fn check(ns: &Netns, api: &ApiServer, config_text: &str) -> Result<Check> {
    let start = Instant::now();
    let settings = settings(config_text)?;
    let (tables, addresses) = read_kernel(ns)?;
    let mut config = settings.build.clone();
    config.local_addresses = addresses;
    let (tracker, slices) = model(api, &settings)?;
    let cluster = complete(&tracker, &settings);
    let mut out = Check {
        services: cluster.services.len(),
        slices,
        endpoints: api
            .list("EndpointSlice")
            .iter()
            .map(|s| s["endpoints"].as_array().map_or(0, Vec::len))
            .sum(),
        ..Check::default()
    };
    for (family, kernel) in &tables {
        let desired = match kernel {
            Some(state) => Desired::build_adopting(&cluster, &config, *family, state),
            None => Desired::build(&cluster, &config, *family),
        };
        let table = desired.table();
        let tx = plan(kernel.as_ref(), &Before::Nothing, table);
        let cleanup = kernel
            .as_ref()
            .map(|k| plan_cleanup(k, table))
            .map_or(0, |t| t.ops.len());
        out.families.push(FamilyCheck {
            family: family.k8s_name(),
            kernel_table: kernel.is_some(),
            kernel_chains: kernel.as_ref().map_or(0, |k| k.chains.len()),
            kernel_sets: kernel.as_ref().map_or(0, |k| k.sets.len()),
            kernel_elements: kernel.as_ref().map_or(0, elements),
            desired_elements: table.sets.values().map(|s| s.elements.len()).sum(),
            ops: tx.ops.len(),
            cleanup_ops: cleanup,
            first_ops: tx.ops.iter().take(SHOW_OPS).map(abbreviated).collect(),
        });
    }
    // The control: one endpoint of the first slice moved to a pod outside the pool.
    let v4 = tables
        .iter()
        .find(|(f, _)| *f == Family::V4)
        .and_then(|(_, s)| s.as_ref());
    if let Some(v4) = v4
        && let Some(first) = api.list("EndpointSlice").into_iter().next()
    {
        let mut moved: Value = first;
        moved["endpoints"][0]["addresses"] = serde_json::json!(["10.255.255.254"]);
        let moved: discovery::EndpointSlice = serde_json::from_value(moved)?;
        let mut tracker = tracker;
        tracker.apply_slice(&moved);
        let cluster = complete(&tracker, &settings);
        let desired = Desired::build_adopting(&cluster, &config, Family::V4, v4);
        out.control_ops = plan(Some(v4), &Before::Nothing, desired.table()).ops.len();
    }
    out.took_ms = start.elapsed().as_secs_f64() * 1e3;
    Ok(out)
}
