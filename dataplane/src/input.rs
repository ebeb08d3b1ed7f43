//! Kubernetes objects from a file: what `kubectl get -o yaml` or `-o json` writes (one
//! `kind: List`), a stream of YAML documents, or a stream of JSON objects (one per line or
//! simply one after another). Objects are handed over one at a time, as they are parsed: the
//! objects of a file never all exist at once, neither typed nor as generic trees.
//!
//! A document or list item that has an `items` array is a list, whatever its `kind` (kubectl's
//! rule, `Unstructured.IsList`); lists may nest. Other objects are typed by their `kind`:
//! Services, EndpointSlices, Nodes and ServiceCIDRs are handed over, other kinds ignored. An
//! object that does not match its kind's schema is skipped with the reason; a syntax error
//! stops the parse (objects before it have been handed over).
//!
//! JSON takes a fast path (`json`): text that starts with `{` or `[` and is a valid stream of
//! JSON values is checked once by serde_json, then every object is typed straight from its own
//! slice of the text. Anything else is read as YAML (JSON is YAML too: a YAML flow mapping that is not JSON
//! still parses): split into documents and a list's items (`split`), each read by a strict
//! reader for the block YAML kubectl writes (`block`); where that reader is unsure, the whole
//! text is read again by serde_yaml_ng, one document at a time, each list item as a tree of
//! its own, and what was handed over already is not handed over twice. Pieces are read on
//! every core, and handed over in file order (`parallel`).

use serde::Deserializer as _;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use k8s_openapi::api::{
    core::v1 as core, discovery::v1 as discovery, networking::v1 as networking,
};

use crate::convert::{Objects, Skip, Skipped};

mod block;
mod json;
mod parallel;
mod pieces;
#[cfg(test)]
mod props;
mod split;

use block::Unsure;
pub use pieces::Cutter;

/// A syntax error, with the position it names when there is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based line and column.
    pub location: Option<(usize, usize)>,
    pub message: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.location {
            Some((line, column)) => write!(f, "line {line} column {column}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for ParseError {}

impl ParseError {
    /// The error of a piece of a file (see [`Cutter`]) that `lines` lines of the file precede:
    /// its line numbers, in the location and the message, become the file's.
    pub fn after_lines(self, lines: usize) -> ParseError {
        let mut message = String::with_capacity(self.message.len());
        let mut rest = self.message.as_str();
        while let Some(i) = rest.find("line ") {
            let (head, tail) = rest.split_at(i + "line ".len());
            message.push_str(head);
            let digits = tail.len() - tail.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            match tail[..digits].parse::<usize>() {
                Ok(n) => message.push_str(&(n + lines).to_string()),
                Err(_) => message.push_str(&tail[..digits]),
            }
            rest = &tail[digits..];
        }
        message.push_str(rest);
        ParseError {
            location: self.location.map(|(line, column)| (line + lines, column)),
            message,
        }
    }
}

impl From<serde_yaml_ng::Error> for ParseError {
    fn from(e: serde_yaml_ng::Error) -> ParseError {
        ParseError {
            location: e.location().map(|l| (l.line(), l.column())),
            message: e.to_string(),
        }
    }
}

/// One object of an input document, before conversion.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Service(Box<core::Service>),
    Slice(Box<discovery::EndpointSlice>),
    Node(Box<core::Node>),
    ServiceCidr(Box<networking::ServiceCIDR>),
}

/// Splits a file's text (see [`crate::input`]: `kind: List`, YAML documents, JSON objects) into
/// typed objects. Objects of other kinds are ignored; objects that do not match their schema
/// are reported in the second return value.
pub fn parse_yaml(text: &str) -> Result<(Objects, Vec<Skipped>), ParseError> {
    let mut objects = Objects::default();
    let mut skipped = Vec::new();
    for_each_object(text, &mut skipped, |o| match o {
        Object::Service(v) => objects.services.push(*v),
        Object::Slice(v) => objects.slices.push(*v),
        Object::Node(v) => objects.nodes.push(*v),
        Object::ServiceCidr(v) => objects.service_cidrs.push(*v),
    })?;
    Ok((objects, skipped))
}

/// Hands every object of `text` to `f`, in file order; objects that do not match their schema
/// go to `skipped`. On a syntax error, `f` has already seen the objects before it.
pub fn for_each_object(
    text: &str,
    skipped: &mut Vec<Skipped>,
    mut f: impl FnMut(Object),
) -> Result<(), ParseError> {
    let mut sink = Sink {
        skipped,
        f: &mut f,
        handed: 0,
        skip: 0,
    };
    if let Some(units) = json::json_units(text) {
        parallel::ordered(
            &units,
            |raw| json::json_outcomes(raw),
            |out| {
                sink.all(out);
                true
            },
        );
        return Ok(());
    }
    // YAML: split and read by the strict reader on every core; where it is unsure, serde_yaml_ng
    // reads the whole text again, and the outcomes already handed over are not handed again
    // (the strict reader agrees with it on everything it accepts).
    if let Some(units) = split::units(text) {
        let mut unsure = false;
        parallel::ordered(&units, yaml_outcomes, |out| match out {
            Ok(out) => {
                sink.all(out);
                true
            }
            Err(Unsure) => {
                unsure = true;
                false
            }
        });
        if !unsure {
            return Ok(());
        }
        sink.skip = std::mem::take(&mut sink.handed);
    }
    read_yaml(text, &mut sink)
}

/// Reads YAML with serde_yaml_ng, one document at a time.
fn read_yaml<F: FnMut(Object)>(text: &str, sink: &mut Sink<'_, F>) -> Result<(), ParseError> {
    for document in serde_yaml_ng::Deserializer::from_str(text) {
        document.deserialize_any(YamlDocument { sink: &mut *sink })?;
    }
    Ok(())
}

/// What one object of a file comes to.
enum Outcome {
    Object(Object),
    Skipped(Skipped),
}

/// One YAML unit by the strict reader.
fn yaml_outcomes(unit: &split::Unit<'_>) -> Result<Vec<Outcome>, Unsure> {
    let mut out = Vec::new();
    match (unit, unit.read()?) {
        (_, None) => {}
        (split::Unit::Item { .. }, Some(value)) => value_outcomes(value, &mut out),
        // A document: a list if its `items` is a sequence; else `items` means nothing.
        (split::Unit::Document { .. }, Some(serde_json::Value::Object(mut map))) => {
            match map.remove("items") {
                Some(serde_json::Value::Array(items)) => {
                    for item in items {
                        value_outcomes(item, &mut out);
                    }
                }
                _ => value_outcomes(serde_json::Value::Object(map), &mut out),
            }
        }
        (split::Unit::Document { .. }, Some(_)) => {}
    }
    Ok(out)
}

/// Types an object that is not a list by its kind: an object, a skipped one, or nothing.
fn typed<E: std::fmt::Display>(
    kind: &str,
    name: impl FnOnce() -> String,
    typed: impl FnOnce(&str) -> Option<Result<Object, E>>,
) -> Option<Outcome> {
    Some(match typed(kind)? {
        Ok(object) => Outcome::Object(object),
        Err(e) => Outcome::Skipped(Skipped {
            kind: kind.to_string(),
            name: name(),
            skip: Skip::Invalid(
                crate::convert::Invalid::Schema,
                format!("does not match the {kind} schema: {e}"),
            ),
        }),
    })
}

/// One YAML list item, or a document that is not a list, as a tree.
fn value_outcomes(value: serde_json::Value, out: &mut Vec<Outcome>) {
    let serde_json::Value::Object(mut map) = value else {
        return;
    };
    if let Some(serde_json::Value::Array(items)) = map.remove("items") {
        for item in items {
            value_outcomes(item, out);
        }
        return;
    }
    let kind = map
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    let name = name_of(map.get("metadata"));
    let value = serde_json::Value::Object(map);
    out.extend(typed(&kind, || name, |kind| typed_object(kind, value)));
}

/// An object of a kind that is handed over, typed by `de` (a JSON text or a tree); `None` for
/// other kinds.
fn typed_object<'de, D: serde::Deserializer<'de>>(
    kind: &str,
    de: D,
) -> Option<Result<Object, D::Error>> {
    use serde::Deserialize;
    Some(match kind {
        "Service" => Deserialize::deserialize(de).map(Object::Service),
        "EndpointSlice" => Deserialize::deserialize(de).map(Object::Slice),
        "Node" => Deserialize::deserialize(de).map(Object::Node),
        "ServiceCIDR" => Deserialize::deserialize(de).map(Object::ServiceCidr),
        _ => return None,
    })
}

/// Where outcomes go, in file order.
struct Sink<'s, F> {
    skipped: &'s mut Vec<Skipped>,
    f: &'s mut F,
    /// Outcomes handed over so far.
    handed: usize,
    /// Outcomes still to drop (handed over already by a reader that gave up).
    skip: usize,
}

impl<F: FnMut(Object)> Sink<'_, F> {
    fn one(&mut self, outcome: Outcome) {
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        self.handed += 1;
        match outcome {
            Outcome::Object(o) => (self.f)(o),
            Outcome::Skipped(s) => self.skipped.push(s),
        }
    }

    fn all(&mut self, out: Vec<Outcome>) {
        for o in out {
            self.one(o);
        }
    }

    fn value(&mut self, value: serde_json::Value) {
        let mut out = Vec::new();
        value_outcomes(value, &mut out);
        self.all(out);
    }
}

/// `namespace/name` (or `name`) of an object's metadata, for messages; empty if missing.
fn name_of(meta: Option<&serde_json::Value>) -> String {
    let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(|v| v.as_str());
    let name = field("name").unwrap_or("");
    match field("namespace") {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

/// One YAML document: a list's items are handed over one at a time as they are parsed; any
/// other object is read as a tree and typed.
struct YamlDocument<'s, 'a, F> {
    sink: &'s mut Sink<'a, F>,
}

impl<'de, F: FnMut(Object)> Visitor<'de> for YamlDocument<'_, '_, F> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a YAML document")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut fields = serde_json::Map::new();
        let mut list = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == "items" {
                // Not an array: the object is no list, and `items` means nothing to its kind.
                list |= map.next_value_seed(YamlItems { sink: self.sink })?;
            } else {
                fields.insert(key, map.next_value()?);
            }
        }
        if !list {
            self.sink.value(serde_json::Value::Object(fields));
        }
        Ok(())
    }

    // Documents that are not objects are ignored.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
    fn visit_newtype_struct<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// A YAML `items` value: if a sequence, each element is handed over as it is parsed (true);
/// anything else is skipped (false).
struct YamlItems<'s, 'a, F> {
    sink: &'s mut Sink<'a, F>,
}

impl<'de, F: FnMut(Object)> DeserializeSeed<'de> for YamlItems<'_, '_, F> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, F: FnMut(Object)> Visitor<'de> for YamlItems<'_, '_, F> {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while let Some(item) = seq.next_element::<serde_json::Value>()? {
            self.sink.value(item);
        }
        Ok(true)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(false)
    }
    fn visit_bool<E>(self, _: bool) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_i64<E>(self, _: i64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_u64<E>(self, _: u64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_f64<E>(self, _: f64) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_str<E>(self, _: &str) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_unit<E>(self) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_none<E>(self) -> Result<bool, E> {
        Ok(false)
    }
    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_newtype_struct<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::Objects;

    fn service(name: &str, ip: &str) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"clusterIP": ip, "ports": [{"port": 80}]},
        })
    }

    /// kubectl's order: `items` before `kind`, and an EndpointSlice's `endpoints` before its
    /// `kind`.
    fn objects() -> Vec<serde_json::Value> {
        vec![
            service("a", "10.96.0.1"),
            serde_json::json!({
                "addressType": "IPv4", "apiVersion": "discovery.k8s.io/v1",
                "endpoints": [{"addresses": ["10.0.0.1"]}], "kind": "EndpointSlice",
                "metadata": {"labels": {"kubernetes.io/service-name": "a"}, "name": "a-1",
                             "namespace": "ns"},
                "ports": [{"port": 8080}],
            }),
            // Does not match the schema: skipped, the rest kept.
            serde_json::json!({"kind": "Service", "metadata": {"name": "bad", "namespace": "ns"},
                               "spec": {"ports": [{"port": "eighty"}]}}),
            serde_json::json!({"kind": "ConfigMap", "metadata": {"name": "c"}}),
            serde_json::json!({"kind": "Node", "metadata": {"name": "node"}}),
            serde_json::json!({"kind": "ServiceCIDR", "metadata": {"name": "k"},
                               "spec": {"cidrs": ["10.96.0.0/12"]}}),
            // A list nested in a list.
            serde_json::json!({"items": [service("b", "10.96.0.2")], "kind": "ServiceList"}),
        ]
    }

    fn summary(text: &str) -> (Vec<String>, Vec<String>) {
        let (o, skipped): (Objects, _) = parse_yaml(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let mut names: Vec<String> = o
            .services
            .iter()
            .map(|s| s.metadata.name.clone().unwrap_or_default())
            .collect();
        names.extend(
            o.slices
                .iter()
                .map(|s| s.metadata.name.clone().unwrap_or_default()),
        );
        names.extend(
            o.nodes
                .iter()
                .map(|s| s.metadata.name.clone().unwrap_or_default()),
        );
        names.extend(
            o.service_cidrs
                .iter()
                .map(|s| s.metadata.name.clone().unwrap_or_default()),
        );
        (names, skipped.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn every_format_yields_the_same_objects() {
        let objects = objects();
        let list = serde_json::json!({"apiVersion": "v1", "items": objects, "kind": "List",
                                      "metadata": {"resourceVersion": ""}});
        let yaml = |v: &serde_json::Value| serde_yaml_ng::to_string(v).unwrap();
        let formats = [
            serde_json::to_string_pretty(&list).unwrap(),
            yaml(&list),
            objects
                .iter()
                .map(|o| format!("---\n{}", yaml(o)))
                .collect(),
            objects.iter().map(|o| format!("{o}\n")).collect(),
            // Concatenated without separators, and a flow-style YAML stream that is not JSON.
            objects.iter().map(|o| o.to_string()).collect(),
            objects
                .iter()
                .map(|o| {
                    let flow = o.to_string().replace('"', "");
                    format!("--- {}\n", flow.replace(':', ": ").replace(',', ", "))
                })
                .collect(),
        ];
        let want = (
            ["a", "b", "a-1", "node", "k"].map(String::from).to_vec(),
            vec![String::from(
                "skipping Service \"ns/bad\": does not match the Service schema: \
                 invalid type: string \"eighty\", expected i32",
            )],
        );
        for text in formats {
            let (names, skipped) = summary(&text);
            assert_eq!(names, want.0, "{text}");
            assert_eq!(skipped.len(), 1, "{skipped:?}");
            assert!(skipped[0].starts_with(&want.1[0]), "{skipped:?}");
        }
    }

    #[test]
    fn a_list_is_an_object_with_an_items_array() {
        // Whatever the kind says; `items` that is not an array makes no list.
        let text = r#"{"kind": "Service", "items": [{"kind": "Node", "metadata": {"name": "n"}}]}
            {"kind": "Node", "metadata": {"name": "m"}, "items": {"a": 1}}"#;
        assert_eq!(summary(text).0, ["n", "m"]);
        let yaml = text.replace('"', "").replace("}\n", "}\n---\n");
        assert_eq!(summary(&yaml).0, ["n", "m"]);
        // Not objects: ignored.
        assert_eq!(summary("[1, 2]\n\"x\"\nnull").0, Vec::<String>::new());
        assert_eq!(summary("--- [1]\n--- x\n---\n").0, Vec::<String>::new());
    }

    #[test]
    fn json_is_split_in_one_pass_into_values_and_a_large_lists_items() {
        // A large list, `items` not first and `kind` last, between two small values.
        let items: Vec<serde_json::Value> = (0..2000)
            .map(|i| service(&format!("s{i}"), "10.96.0.1"))
            .collect();
        let list = serde_json::json!({"metadata": {"x": "\"items\": []"}, "items": items,
                                      "apiVersion": "v1", "kind": "List"});
        let list = serde_json::to_string_pretty(&list).unwrap();
        assert!(list.len() > 1 << 16);
        let small = r#"{"kind": "List", "items": [{"kind": "Node"}]}"#;
        let text = format!(" \n{small}\n\t{list}\n[1, \"a\\\"\"] 2 \"x\" null\n");
        let units = json::json_units(&text).unwrap();
        assert_eq!(units.len(), 1 + 2000 + 4);
        assert_eq!(units[0], small);
        for (unit, item) in units[1..2001].iter().zip(&items) {
            assert_eq!(
                &serde_json::from_str::<serde_json::Value>(unit).unwrap(),
                item
            );
        }
        assert_eq!(units[2001..], ["[1, \"a\\\"\"]", "2", "\"x\"", "null"]);
        // A large object without `items`, or whose `items` is no array, is one unit.
        let big = list.replace("\"items\"", "\"things\"");
        assert_eq!(json::json_units(&big).unwrap(), [big.trim_end()]);
        // Not a stream of JSON values: read as YAML.
        for text in ["{a: 1}", "{\"a\": 1} x", "{\"a\": 1", "kind: List", "1"] {
            assert_eq!(json::json_units(text), None, "{text}");
        }
        assert_eq!(
            summary("{\"kind\": \"Node\", metadata: {name: y}}").0,
            ["y"]
        );
    }

    #[test]
    fn syntax_errors_name_the_line() {
        let text = "kind: Node\nmetadata: {name: a}\n---\nkind: Node\nmetadata: [x\n";
        let mut seen = 0;
        let err = for_each_object(text, &mut Vec::new(), |_| seen += 1).unwrap_err();
        assert_eq!(seen, 1);
        assert!(err.location.is_some_and(|(line, _)| line >= 5), "{err}");
        assert!(err.to_string().starts_with("line "), "{err}");
        // Broken JSON is read as YAML, and fails as YAML.
        let err = parse_yaml("{\"kind\": \"Node\",\n \"metadata\": {\"name\": \"a\"}").unwrap_err();
        assert!(err.location.is_some(), "{err}");
    }
}
