//! The object store: current objects, a monotonically increasing resourceVersion, and the
//! change history watches replay from (until it is compacted).

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// A resource kind the server knows.
#[derive(Debug, PartialEq, Eq)]
pub struct Kind {
    pub kind: &'static str,
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub namespaced: bool,
}

impl Kind {
    /// `v1` for the core group, `group/version` otherwise.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

pub const KINDS: &[Kind] = &[
    Kind {
        kind: "Service",
        group: "",
        version: "v1",
        plural: "services",
        singular: "service",
        namespaced: true,
    },
    Kind {
        kind: "Node",
        group: "",
        version: "v1",
        plural: "nodes",
        singular: "node",
        namespaced: false,
    },
    Kind {
        kind: "EndpointSlice",
        group: "discovery.k8s.io",
        version: "v1",
        plural: "endpointslices",
        singular: "endpointslice",
        namespaced: true,
    },
    Kind {
        kind: "ServiceCIDR",
        group: "networking.k8s.io",
        version: "v1",
        plural: "servicecidrs",
        singular: "servicecidr",
        namespaced: false,
    },
];

/// Finds a kind by its name (`Service`), case-insensitively, or by its plural (`services`).
pub fn kind_named(name: &str) -> Option<&'static Kind> {
    KINDS
        .iter()
        .find(|k| k.kind.eq_ignore_ascii_case(name) || k.plural == name)
}

/// An API error, rendered as a `Status` object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
        }
    }

    pub fn expired(message: impl Into<String>) -> ApiError {
        ApiError::new(410, "Expired", message)
    }

    pub fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

/// Objects are keyed by kind, namespace ("" for cluster-scoped kinds) and name, so a
/// `BTreeMap` range over one kind lists it sorted by namespace and name.
pub type Key = (&'static str, String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeType {
    Added,
    Modified,
    Deleted,
}

/// One write. `new` is the object after it (for a deletion: the last state, carrying the
/// deletion's resourceVersion); `old` the object before it.
#[derive(Debug, Clone)]
pub struct Change {
    pub rv: u64,
    pub key: Key,
    pub ty: ChangeType,
    pub old: Option<Value>,
    pub new: Value,
}

#[derive(Default)]
pub struct Store {
    rv: u64,
    uids: u64,
    objects: BTreeMap<Key, Value>,
    /// Every change with a resourceVersion above `compacted`, oldest first.
    history: Vec<Change>,
    compacted: u64,
}

impl Store {
    /// The resourceVersion of the latest write.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    /// Watches and exact lists from a resourceVersion below this are `410 Gone`.
    pub fn compacted(&self) -> u64 {
        self.compacted
    }

    /// Forgets the history up to now.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    pub fn get(&self, kind: &Kind, ns: &str, name: &str) -> Option<&Value> {
        self.objects.get(&key(kind, ns, name))
    }

    /// Creates or replaces; `create_only` / `replace_only` turn the other case into an error.
    /// A replace carrying a `metadata.resourceVersion` must match the stored one.
    pub fn write(
        &mut self,
        mut obj: Value,
        create_only: bool,
        replace_only: bool,
    ) -> Result<Value, ApiError> {
        let (kind, k) = identify(&mut obj)?;
        let old = self.objects.get(&k).cloned();
        match &old {
            Some(_) if create_only => {
                return Err(ApiError::new(
                    409,
                    "AlreadyExists",
                    format!("{} \"{}\" already exists", kind.plural, k.2),
                ));
            }
            None if replace_only => return Err(not_found(kind, &k.2)),
            Some(old) if replace_only => {
                let want = &obj["metadata"]["resourceVersion"];
                if want.is_string() && *want != old["metadata"]["resourceVersion"] {
                    return Err(ApiError::new(
                        409,
                        "Conflict",
                        format!(
                            "Operation cannot be fulfilled on {} \"{}\": the object has been \
                             modified; please apply your changes to the latest version and try again",
                            kind.plural, k.2
                        ),
                    ));
                }
            }
            _ => {}
        }
        self.rv += 1;
        let meta = obj["metadata"]
            .as_object_mut()
            .expect("checked by identify");
        meta.insert("resourceVersion".into(), self.rv.to_string().into());
        if let Some(old) = &old {
            for field in ["uid", "creationTimestamp"] {
                meta.insert(field.into(), old["metadata"][field].clone());
            }
        } else {
            self.uids += 1;
            let uid = format!("00000000-0000-4000-8000-{:012x}", self.uids);
            meta.insert("uid".into(), uid.into());
            meta.insert("creationTimestamp".into(), now_rfc3339().into());
        }
        let ty = match old {
            Some(_) => ChangeType::Modified,
            None => ChangeType::Added,
        };
        self.objects.insert(k.clone(), obj.clone());
        self.history.push(Change {
            rv: self.rv,
            key: k,
            ty,
            old,
            new: obj.clone(),
        });
        Ok(obj)
    }

    /// Deletes an object, returning its last state (with the deletion's resourceVersion).
    pub fn delete(&mut self, kind: &'static Kind, ns: &str, name: &str) -> Result<Value, ApiError> {
        let k = key(kind, ns, name);
        let old = self
            .objects
            .remove(&k)
            .ok_or_else(|| not_found(kind, name))?;
        self.rv += 1;
        let mut last = old.clone();
        last["metadata"]["resourceVersion"] = self.rv.to_string().into();
        self.history.push(Change {
            rv: self.rv,
            key: k,
            ty: ChangeType::Deleted,
            old: Some(old),
            new: last.clone(),
        });
        Ok(last)
    }

    /// The objects of `kind` as they were at resourceVersion `at` (now if `None`), sorted by
    /// namespace and name. `410 Expired` if that point was compacted away.
    pub fn snapshot(&self, kind: &Kind, at: Option<u64>) -> Result<Vec<(Key, Value)>, ApiError> {
        let mut objs: BTreeMap<Key, Value> = self
            .objects
            .range(key(kind, "", "")..)
            .take_while(|(k, _)| k.0 == kind.kind)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if let Some(at) = at.filter(|at| *at < self.rv) {
            if at < self.compacted {
                return Err(ApiError::expired(format!(
                    "too old resource version: {at} ({})",
                    self.compacted
                )));
            }
            for c in self.history.iter().rev().take_while(|c| c.rv > at) {
                if c.key.0 != kind.kind {
                    continue;
                }
                match &c.old {
                    Some(old) => objs.insert(c.key.clone(), old.clone()),
                    None => objs.remove(&c.key),
                };
            }
        }
        Ok(objs.into_iter().collect())
    }

    /// One page of a list of `kind` as it was at resourceVersion `at` (now if `None`): at most
    /// `limit` objects that `keep` accepts, sorted by namespace and name, after `after`; and
    /// whether more follow. Costs the page, not the whole kind, as the API server's watch
    /// cache does: a list of N objects in pages is O(N), not O(N²).
    pub fn page(
        &self,
        kind: &Kind,
        at: Option<u64>,
        after: Option<&(String, String)>,
        limit: usize,
        keep: impl Fn(&Value) -> bool,
    ) -> Result<(Vec<(Key, Value)>, bool), ApiError> {
        use std::collections::Bound;
        use std::ops::RangeBounds;
        // What the changes since `at` replaced: the objects as they were then (`None`: absent).
        let mut then: BTreeMap<&Key, Option<&Value>> = BTreeMap::new();
        if let Some(at) = at.filter(|at| *at < self.rv) {
            if at < self.compacted {
                return Err(ApiError::expired(format!(
                    "too old resource version: {at} ({})",
                    self.compacted
                )));
            }
            for c in self.history.iter().rev().take_while(|c| c.rv > at) {
                if c.key.0 == kind.kind {
                    then.insert(&c.key, c.old.as_ref());
                }
            }
        }
        let first = key(kind, "", "");
        let from = match after {
            Some((ns, name)) => Bound::Excluded(key(kind, ns, name)),
            None => Bound::Included(first),
        };
        let mut now = self
            .objects
            .range((from.clone(), Bound::Unbounded))
            .take_while(|(k, _)| k.0 == kind.kind)
            .peekable();
        let bounds = (from.as_ref(), Bound::Unbounded);
        let mut old = then
            .iter()
            .filter(|(k, _)| bounds.contains(**k))
            .map(|(k, v)| (*k, *v))
            .peekable();
        let mut page = Vec::new();
        loop {
            // Merge the two sorted sequences; where both have a key, the old state wins.
            let next = match (now.peek(), old.peek()) {
                (None, None) => return Ok((page, false)),
                (Some((k, _)), Some((o, _))) if *o <= *k => {
                    if *o == *k {
                        now.next();
                    }
                    old.next().expect("peeked")
                }
                (Some(_), _) => now.next().map(|(k, v)| (k, Some(v))).expect("peeked"),
                (None, Some(_)) => old.next().expect("peeked"),
            };
            let (k, Some(v)) = next else { continue };
            if !keep(v) {
                continue;
            }
            if page.len() == limit {
                return Ok((page, true));
            }
            page.push((k.clone(), v.clone()));
        }
    }

    /// The changes to `kind` after resourceVersion `after`, oldest first; `410 Expired` if
    /// some of them were compacted away.
    pub fn changes_after(&self, kind: &Kind, after: u64) -> Result<Vec<Change>, ApiError> {
        if after < self.compacted {
            return Err(ApiError::expired(format!(
                "too old resource version: {after} ({})",
                self.compacted
            )));
        }
        let start = self.history.partition_point(|c| c.rv <= after);
        Ok(self.history[start..]
            .iter()
            .filter(|c| c.key.0 == kind.kind)
            .cloned()
            .collect())
    }
}

fn key(kind: &Kind, ns: &str, name: &str) -> Key {
    let ns = if kind.namespaced { ns } else { "" };
    (kind.kind, ns.to_string(), name.to_string())
}

fn not_found(kind: &Kind, name: &str) -> ApiError {
    let group = if kind.group.is_empty() {
        String::new()
    } else {
        format!(".{}", kind.group)
    };
    ApiError::new(
        404,
        "NotFound",
        format!("{}{group} \"{name}\" not found", kind.plural),
    )
}

/// Checks an object's kind and name, fills `apiVersion` and the namespace (`default` if a
/// namespaced object has none; removed from cluster-scoped ones), and returns its key.
fn identify(obj: &mut Value) -> Result<(&'static Kind, Key), ApiError> {
    let bad = |m: String| ApiError::new(400, "BadRequest", m);
    let kind_name = obj["kind"].as_str().unwrap_or_default();
    let kind = KINDS
        .iter()
        .find(|k| k.kind == kind_name)
        .ok_or_else(|| bad(format!("unsupported kind {kind_name:?}")))?;
    let api_version = kind.api_version();
    match obj["apiVersion"].as_str() {
        None => obj["apiVersion"] = api_version.into(),
        Some(v) if v == api_version => {}
        Some(v) => return Err(bad(format!("{kind_name} must be {api_version}, not {v}"))),
    }
    let meta = obj
        .get_mut("metadata")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| bad("metadata missing".into()))?;
    let name = meta
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad("metadata.name missing".into()))?
        .to_string();
    let ns = if kind.namespaced {
        let ns = meta.get("namespace").and_then(Value::as_str).unwrap_or("");
        let ns = if ns.is_empty() { "default" } else { ns }.to_string();
        meta.insert("namespace".into(), ns.clone().into());
        ns
    } else {
        meta.remove("namespace");
        String::new()
    };
    Ok((kind, (kind.kind, ns, name)))
}

/// Now as RFC 3339 in UTC with second precision, like `metav1.Time`.
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, port: u16) -> Value {
        json!({"kind": "Service", "metadata": {"name": name}, "spec": {"ports": [{"port": port}]}})
    }

    #[test]
    fn writes_snapshots_and_compaction() {
        let svcs = kind_named("Service").unwrap();
        let mut s = Store::default();
        s.write(svc("a", 1), false, false).unwrap();
        s.write(svc("b", 1), false, false).unwrap();
        let a2 = s.write(svc("a", 2), false, false).unwrap();
        assert_eq!(a2["metadata"]["resourceVersion"], "3");
        assert_eq!(a2["metadata"]["namespace"], "default");
        assert_eq!(
            a2["metadata"]["uid"],
            "00000000-0000-4000-8000-000000000001"
        );
        s.delete(svcs, "default", "b").unwrap();
        let names = |v: Vec<(Key, Value)>| v.into_iter().map(|(k, _)| k.2).collect::<Vec<_>>();
        assert_eq!(names(s.snapshot(svcs, None).unwrap()), ["a"]);
        let at2 = s.snapshot(svcs, Some(2)).unwrap();
        assert_eq!(names(at2.clone()), ["a", "b"]);
        assert_eq!(at2[0].1["spec"]["ports"][0]["port"], 1);
        assert_eq!(s.changes_after(svcs, 2).unwrap().len(), 2);
        s.compact();
        assert_eq!(s.snapshot(svcs, Some(2)).unwrap_err().code, 410);
        assert_eq!(s.changes_after(svcs, 3).unwrap_err().code, 410);
        assert!(s.changes_after(svcs, 4).unwrap().is_empty());
        assert_eq!(s.write(svc("a", 3), true, false).unwrap_err().code, 409);
        assert!(now_rfc3339().ends_with('Z'));
    }

    #[test]
    fn pages_equal_the_snapshot_they_started_from() {
        let svcs = kind_named("Service").unwrap();
        let mut s = Store::default();
        for (i, name) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            s.write(svc(name, i as u16), false, false).unwrap();
        }
        let at = s.rv();
        // After the list started: one changed, one deleted, one added, one other kind.
        s.write(svc("b", 99), false, false).unwrap();
        s.delete(svcs, "default", "c").unwrap();
        s.write(svc("bb", 1), false, false).unwrap();
        s.write(
            json!({"kind": "Node", "metadata": {"name": "n"}}),
            false,
            false,
        )
        .unwrap();
        let keep_all = |_: &Value| true;
        for limit in 1..=6 {
            let (mut seen, mut after) = (Vec::new(), None);
            loop {
                let (page, more) = s
                    .page(svcs, Some(at), after.as_ref(), limit, keep_all)
                    .unwrap();
                assert!(page.len() <= limit);
                let last = page.last().map(|(k, _)| (k.1.clone(), k.2.clone()));
                seen.extend(page);
                if !more {
                    break;
                }
                after = last;
            }
            assert_eq!(seen, s.snapshot(svcs, Some(at)).unwrap(), "limit {limit}");
        }
        // Now, with a filter: only odd ports.
        let odd = |o: &Value| o["spec"]["ports"][0]["port"].as_u64().unwrap() % 2 == 1;
        let (page, more) = s.page(svcs, None, None, 10, odd).unwrap();
        let names: Vec<_> = page.iter().map(|(k, _)| k.2.as_str()).collect();
        assert_eq!((names, more), (vec!["b", "bb", "d"], false));
        s.compact();
        assert_eq!(
            s.page(svcs, Some(at), None, 1, keep_all).unwrap_err().code,
            410
        );
    }
}
