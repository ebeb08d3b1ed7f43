//! Label and field selectors as the apiserver parses them from `labelSelector` and
//! `fieldSelector` query parameters, and the filter a LIST or WATCH applies.

use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Exists,
    NotExists,
    Eq(String),
    Ne(String),
    In(Vec<String>),
    NotIn(Vec<String>),
}

/// A conjunction of label requirements: `k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
/// `k notin (a,b)`, joined by commas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<(String, Op)>);

impl LabelSelector {
    pub fn parse(s: &str) -> Result<LabelSelector, String> {
        let mut reqs = Vec::new();
        for part in split_top_level(s) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let bad = || format!("unable to parse requirement {part:?}");
            if let Some(key) = part.strip_prefix('!') {
                reqs.push((label_key(key.trim()).ok_or_else(bad)?, Op::NotExists));
                continue;
            }
            let end = part.find([' ', '=', '!', '(']).unwrap_or(part.len());
            let key = label_key(&part[..end]).ok_or_else(bad)?;
            let rest = part[end..].trim_start();
            let op = if rest.is_empty() {
                Op::Exists
            } else if let Some(v) = rest.strip_prefix("!=") {
                Op::Ne(label_value(v).ok_or_else(bad)?)
            } else if let Some(v) = rest.strip_prefix("==").or_else(|| rest.strip_prefix('=')) {
                Op::Eq(label_value(v).ok_or_else(bad)?)
            } else if let Some(set) = rest.strip_prefix("notin") {
                Op::NotIn(value_set(set).ok_or_else(bad)?)
            } else if let Some(set) = rest.strip_prefix("in") {
                Op::In(value_set(set).ok_or_else(bad)?)
            } else {
                return Err(bad());
            };
            reqs.push((key, op));
        }
        Ok(LabelSelector(reqs))
    }

    /// Whether an object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj["metadata"]["labels"].as_object();
        self.0.iter().all(|(key, op)| {
            let v = labels.and_then(|l| l.get(key)).and_then(Value::as_str);
            match op {
                Op::Exists => v.is_some(),
                Op::NotExists => v.is_none(),
                Op::Eq(want) => v == Some(want),
                Op::Ne(want) => v != Some(want),
                Op::In(set) => v.is_some_and(|v| set.iter().any(|s| s == v)),
                Op::NotIn(set) => v.is_none_or(|v| set.iter().all(|s| s != v)),
            }
        })
    }
}

/// Splits on commas outside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn label_key(k: &str) -> Option<String> {
    let ok = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
    ok.then(|| k.to_string())
}

fn label_value(v: &str) -> Option<String> {
    let v = v.trim();
    let ok = v
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    ok.then(|| v.to_string())
}

/// ` (a, b)` after `in` / `notin`.
fn value_set(s: &str) -> Option<Vec<String>> {
    let inner = s.trim().strip_prefix('(')?.strip_suffix(')')?;
    inner.split(',').map(label_value).collect()
}

/// `metadata.name` and `metadata.namespace` with `=`, `==` or `!=`, joined by commas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<FieldSelector, String> {
        let mut reqs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (field, eq, value) = if let Some((f, v)) = part.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                (f, true, v)
            } else {
                return Err(format!("invalid field selector {part:?}"));
            };
            let field = field.trim();
            if !["metadata.name", "metadata.namespace"].contains(&field) {
                return Err(format!("field label not supported: {field}"));
            }
            reqs.push((field.to_string(), eq, value.trim().to_string()));
        }
        Ok(FieldSelector(reqs))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, eq, want)| {
            let path = field.strip_prefix("metadata.").unwrap_or(field);
            let v = obj["metadata"][path].as_str().unwrap_or("");
            (v == want) == *eq
        })
    }
}

/// What a LIST or WATCH selects: an optional namespace (from the path) and the selectors.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, obj: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| obj["metadata"]["namespace"] == ns)
            && self.labels.matches(obj)
            && self.fields.matches(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "x", "namespace": "ns", "labels": labels}})
    }

    #[test]
    fn label_selectors() {
        let o = obj(json!({"app": "web", "tier": "front"}));
        let cases = [
            ("", true),
            ("app", true),
            ("!app", false),
            ("!service.kubernetes.io/service-proxy-name", true),
            ("app=web", true),
            ("app==web,tier=back", false),
            ("app!=web", false),
            ("zone!=a", true),
            ("app in (web, db)", true),
            ("app in (db),tier", false),
            ("app notin (db)", true),
            ("zone notin (a)", true),
            ("tier notin (front,back)", false),
        ];
        for (sel, want) in cases {
            assert_eq!(
                LabelSelector::parse(sel).unwrap().matches(&o),
                want,
                "{sel}"
            );
        }
        assert!(
            LabelSelector::parse("!app")
                .unwrap()
                .matches(&obj(Value::Null))
        );
        for bad in ["app in web", "a b", "=x", "app=(x"] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn field_selectors() {
        let o = obj(Value::Null);
        let f = |s: &str| FieldSelector::parse(s).unwrap().matches(&o);
        assert!(f("metadata.name=x,metadata.namespace==ns"));
        assert!(!f("metadata.name!=x"));
        assert!(FieldSelector::parse("spec.clusterIP=1").is_err());
    }
}
