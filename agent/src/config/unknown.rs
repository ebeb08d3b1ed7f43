//! Keys of a configuration file that kube-proxy does not know, at every level. The known keys
//! are the typed model's own (its default, serialised), so this list cannot fall behind it.

use serde_json::Value as Json;
use serde_yaml_ng::Value as Yaml;

use super::fields::{KubeProxyConfiguration, UnknownField, VModuleItem};

/// Free-form maps: any key is valid there.
const FREE_FORM: &[&str] = &["featureGates"];

/// Every key of `doc` (a parsed file) that is not a `KubeProxyConfiguration` field.
pub(super) fn unknown_fields(doc: &Yaml) -> Vec<UnknownField> {
    let schema = serde_json::to_value(KubeProxyConfiguration::default()).unwrap_or(Json::Null);
    let mut found = Vec::new();
    walk(doc, &schema, "", &mut found);
    found
}

fn walk(doc: &Yaml, schema: &Json, path: &str, found: &mut Vec<UnknownField>) {
    let (Yaml::Mapping(map), Json::Object(known)) = (doc, schema) else {
        return;
    };
    for (key, value) in map {
        let name = key_text(key);
        let child = if path.is_empty() {
            name.clone()
        } else {
            format!("{path}.{name}")
        };
        match known.get(&name) {
            None => found.push(UnknownField {
                did_you_mean: known
                    .keys()
                    .find(|k| k.eq_ignore_ascii_case(&name))
                    .cloned(),
                path: child,
            }),
            Some(_) if FREE_FORM.contains(&child.as_str()) => {}
            Some(_) if child == "logging.vmodule" => walk_vmodule(value, &child, found),
            Some(schema) => walk(value, schema, &child, found),
        }
    }
}

/// `logging.vmodule` is a list of `{filePattern, verbosity}` entries.
fn walk_vmodule(doc: &Yaml, path: &str, found: &mut Vec<UnknownField>) {
    let Yaml::Sequence(items) = doc else {
        return;
    };
    let schema = serde_json::to_value(VModuleItem::default()).unwrap_or(Json::Null);
    for (i, item) in items.iter().enumerate() {
        walk(item, &schema, &format!("{path}[{i}]"), found);
    }
}

/// A key as Go's YAML reader turns it into a JSON key.
fn key_text(key: &Yaml) -> String {
    match key {
        Yaml::String(s) => s.clone(),
        Yaml::Bool(b) => b.to_string(),
        Yaml::Number(n) => n.to_string(),
        Yaml::Null => "null".to_string(),
        other => format!("{other:?}"),
    }
}
