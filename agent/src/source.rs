//! The YAML file source: Kubernetes objects as `kubectl get ... -o yaml` prints them.

use std::path::Path;

use dataplane::convert::{self, Skipped};
use dataplane::model::Cluster;
use dataplane::tracker::{Kind, Tracker};

/// Reads and converts a YAML file. An unreadable or unparseable file is an error (naming the
/// file and line); invalid objects inside it are returned as skipped and otherwise ignored.
pub fn load_file(
    path: &Path,
    node_name: &str,
    proxy_name: &str,
) -> Result<(Cluster, Vec<Skipped>), String> {
    let text = read(path)?;
    load_text(&text, node_name, proxy_name).map_err(|e| format!("{}: {e}", path.display()))
}

/// Converts YAML text already in memory (see [`load_file`]).
pub fn load_text(
    text: &str,
    node_name: &str,
    proxy_name: &str,
) -> Result<(Cluster, Vec<Skipped>), String> {
    let (objects, mut skipped) = convert::parse_yaml(text).map_err(|e| yaml_error(&e))?;
    let (cluster, more) = convert::cluster(&objects, node_name, proxy_name);
    skipped.extend(more);
    Ok((cluster, skipped))
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Logs each skipped object once, with its kind, name and reason.
pub fn report_skipped(skipped: &[Skipped]) {
    for s in skipped {
        tracing::warn!(kind = %s.kind, name = %s.name, reason = %s.skip, "skipping invalid object");
    }
}

/// Replaces the tracker's content with the objects of a YAML file, as a re-list of every kind
/// would: objects missing from the file are deleted, unchanged ones cause no sync.
pub fn load_into(tracker: &mut Tracker, path: &Path) -> Result<(), String> {
    let text = read(path)?;
    let (objects, skipped) = convert::parse_yaml(&text)
        .map_err(|e| format!("{}: {}", path.display(), yaml_error(&e)))?;
    report_skipped(&skipped);
    let mut invalid = Vec::new();
    tracker.begin_list(Kind::Service);
    invalid.extend(
        objects
            .services
            .iter()
            .filter_map(|o| tracker.apply_service(o)),
    );
    tracker.end_list(Kind::Service);
    tracker.begin_list(Kind::EndpointSlice);
    invalid.extend(objects.slices.iter().filter_map(|o| tracker.apply_slice(o)));
    tracker.end_list(Kind::EndpointSlice);
    tracker.begin_list(Kind::Node);
    invalid.extend(objects.nodes.iter().filter_map(|o| tracker.apply_node(o)));
    tracker.end_list(Kind::Node);
    tracker.begin_list(Kind::ServiceCidr);
    invalid.extend(
        objects
            .service_cidrs
            .iter()
            .filter_map(|o| tracker.apply_service_cidr(o)),
    );
    tracker.end_list(Kind::ServiceCidr);
    report_skipped(&invalid);
    Ok(())
}

/// A YAML error with the line and column it names.
fn yaml_error(e: &serde_yaml_ng::Error) -> String {
    match e.location() {
        Some(l) => format!("line {} column {}: {e}", l.line(), l.column()),
        None => e.to_string(),
    }
}
