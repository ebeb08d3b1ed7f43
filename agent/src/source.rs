//! The YAML file source: Kubernetes objects as `kubectl get ... -o yaml` prints them.

use std::path::Path;

use dataplane::convert::{self, Object, Skipped};
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
/// would: objects missing from the file are deleted, unchanged ones cause no sync. A file that
/// cannot be parsed changes nothing.
pub fn load_into(tracker: &mut Tracker, path: &Path) -> Result<(), String> {
    let text = read(path)?;
    let mut staged = tracker.clone();
    for kind in Kind::ALL {
        staged.begin_list(kind);
    }
    let mut skipped = Vec::new();
    let mut invalid = Vec::new();
    // Each object is applied as soon as it is parsed, so that the file's objects never all
    // exist at once.
    convert::for_each_object(&text, &mut skipped, |object| {
        invalid.extend(match &object {
            Object::Service(o) => staged.apply_service(o),
            Object::Slice(o) => staged.apply_slice(o),
            Object::Node(o) => staged.apply_node(o),
            Object::ServiceCidr(o) => staged.apply_service_cidr(o),
        })
    })
    .map_err(|e| format!("{}: {}", path.display(), yaml_error(&e)))?;
    for kind in Kind::ALL {
        staged.end_list(kind);
    }
    *tracker = staged;
    report_skipped(&skipped);
    report_skipped(&invalid);
    drop(text);
    crate::memory::release_freed();
    Ok(())
}

/// A YAML error with the line and column it names.
fn yaml_error(e: &serde_yaml_ng::Error) -> String {
    match e.location() {
        Some(l) => format!("line {} column {}: {e}", l.line(), l.column()),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::model::ObjectName;

    fn service(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\n\
             spec: {{clusterIP: {ip}, ports: [{{port: 80, protocol: TCP}}]}}\n"
        )
    }

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let path =
            std::env::temp_dir().join(format!("nftproxy-source-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_file_broken_half_way_changes_nothing() {
        let mut tracker = Tracker::new("node", "");
        let good = write("good.yaml", &service("a", "10.96.0.1"));
        load_into(&mut tracker, &good).unwrap();
        let names = |t: &Tracker| t.cluster().services.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&tracker), [ObjectName::new("ns", "a")]);

        // b parses, then the YAML breaks: neither b's arrival nor a's removal may take effect.
        let broken = write(
            "broken.yaml",
            &format!(
                "{}---\nkind: Service\nmetadata: [unterminated\n",
                service("b", "10.96.0.2")
            ),
        );
        let err = load_into(&mut tracker, &broken).unwrap_err();
        assert!(err.contains("broken.yaml") && err.contains("line"), "{err}");
        assert_eq!(names(&tracker), [ObjectName::new("ns", "a")]);

        let next = write("next.yaml", &service("b", "10.96.0.2"));
        load_into(&mut tracker, &next).unwrap();
        assert_eq!(names(&tracker), [ObjectName::new("ns", "b")]);
        for p in [good, broken, next] {
            let _ = std::fs::remove_file(p);
        }
    }
}
