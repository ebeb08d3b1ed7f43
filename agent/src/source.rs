//! The YAML file source: Kubernetes objects as `kubectl get ... -o yaml` prints them.

use std::path::Path;

use dataplane::convert::{self, Skipped};
use dataplane::model::Cluster;

/// Reads and converts a YAML file. An unreadable or unparseable file is an error (naming the
/// file and line); invalid objects inside it are returned as skipped and otherwise ignored.
pub fn load_file(
    path: &Path,
    node_name: &str,
    proxy_name: &str,
) -> Result<(Cluster, Vec<Skipped>), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (objects, mut skipped) = convert::parse_yaml(&text).map_err(|e| match e.location() {
        Some(l) => format!(
            "{}: line {} column {}: {e}",
            path.display(),
            l.line(),
            l.column()
        ),
        None => format!("{}: {e}", path.display()),
    })?;
    let (cluster, more) = convert::cluster(&objects, node_name, proxy_name);
    skipped.extend(more);
    Ok((cluster, skipped))
}

/// Logs each skipped object once, with its kind, name and reason.
pub fn report_skipped(skipped: &[Skipped]) {
    for s in skipped {
        tracing::warn!(kind = %s.kind, name = %s.name, reason = %s.skip, "skipping invalid object");
    }
}
