//! The JSON fast path: a stream of JSON values is checked in one pass, split into units (each
//! value, or a large list's items), and each unit is typed straight from its own slice.

use serde::Deserializer as _;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{Object, Outcome, name_of, typed, typed_object};

/// The units of `text` if it is a stream of JSON values (checked completely before anything is
/// handed over), `None` if it is not JSON: each top-level value, or the items of a large list.
/// One pass: each value is read once, by the envelope reader, and its text located by the
/// stream's byte offsets.
pub(super) fn json_units(text: &str) -> Option<Vec<&str>> {
    let first = text.trim_start_matches(['\u{feff}', ' ', '\t', '\r', '\n']);
    if !first.starts_with(['{', '[']) {
        return None;
    }
    let mut documents = serde_json::Deserializer::from_str(first).into_iter::<TopLevel>();
    let mut units = Vec::new();
    let mut start = 0;
    while let Some(document) = documents.next() {
        let TopLevel(envelope) = document.ok()?;
        let end = documents.byte_offset();
        let raw = first[start..end].trim_start_matches([' ', '\t', '\r', '\n']);
        start = end;
        match envelope {
            // A large list is split into its items, so that they are read in parallel.
            Some(Envelope {
                items: Some(items), ..
            }) if raw.len() > 1 << 16 => units.extend(items.into_iter().map(RawValue::get)),
            _ => units.push(raw),
        }
    }
    Some(units)
}

/// One JSON value (a document or a list item). The text was checked already: a value this
/// cannot read is not an object and is ignored.
pub(super) fn json_outcomes(text: &str) -> Vec<Outcome> {
    let mut out = Vec::new();
    json_value(text, &mut out);
    out
}

fn json_value(text: &str, out: &mut Vec<Outcome>) {
    if !text.starts_with('{') {
        return;
    }
    // Most objects: their kind found by a scan, then one parse, the typed one.
    if let Some(kind) = plain_kind(text) {
        out.extend(typed(
            kind,
            || name_of_text(text),
            |kind| typed_json(kind, text),
        ));
        return;
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let Ok(envelope) = (&mut de).deserialize_map(JsonEnvelope) else {
        return;
    };
    if let Some(items) = envelope.items {
        for item in items {
            json_value(item.get(), out);
        }
        return;
    }
    let kind = envelope.kind.unwrap_or_default();
    out.extend(typed(
        &kind,
        || envelope.metadata.map(name_of_json).unwrap_or_default(),
        |kind| typed_json(kind, text),
    ));
}

/// An object of a kind that is handed over, typed from its text (one value, checked already).
fn typed_json(kind: &str, text: &str) -> Option<Result<Object, serde_json::Error>> {
    typed_object(kind, &mut serde_json::Deserializer::from_str(text))
}

/// The name of an object, from its metadata (for the message when it does not match its
/// schema).
fn name_of_text(text: &str) -> String {
    let mut de = serde_json::Deserializer::from_str(text);
    match (&mut de).deserialize_map(JsonEnvelope) {
        Ok(envelope) => envelope.metadata.map(name_of_json).unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The `kind` of a JSON object whose text was checked already, found by a scan of its bytes
/// (string contents skipped with `memchr`) rather than a parse: `Some` only when that is
/// plain, with no key at the object's top level being `items` or holding an escape, and
/// `kind` there at most once, as a string without escapes (`""` when missing). `None`
/// leaves the object to the envelope reader.
fn plain_kind(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    if b.first() != Some(&b'{') {
        return None;
    }
    let mut kind = None;
    let mut depth = 0usize;
    // At the top level, after `{` or `,`: the next string is a key.
    let mut key_next = false;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let (end, escaped) = string_end(b, i + 1)?;
                let key = (depth == 1 && key_next).then(|| &b[i + 1..end]);
                key_next = false;
                i = end + 1;
                match key {
                    Some(_) if escaped => return None,
                    Some(b"items") => return None,
                    Some(b"kind") => {
                        if kind.is_some() {
                            return None;
                        }
                        // `"kind"`, blanks, `:`, blanks, then a string without escapes.
                        let colon = i + b[i..].iter().position(|c| !is_blank(*c))?;
                        let open = colon + 1 + b[colon + 1..].iter().position(|c| !is_blank(*c))?;
                        if b[colon] != b':' || b[open] != b'"' {
                            return None;
                        }
                        let (close, escaped) = string_end(b, open + 1)?;
                        if escaped {
                            return None;
                        }
                        kind = Some(&text[open + 1..close]);
                        i = close + 1;
                    }
                    _ => {}
                }
                continue;
            }
            b'{' | b'[' => {
                depth += 1;
                key_next = depth == 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                key_next = false;
                if depth == 0 {
                    break;
                }
            }
            b',' => key_next = depth == 1,
            _ => {}
        }
        i += 1;
        // Nothing else matters: skip to the next byte that does.
        i += b[i.min(b.len())..]
            .iter()
            .position(|c| KIND_SCAN[usize::from(*c)])
            .unwrap_or(b.len() - i.min(b.len()));
    }
    Some(kind.unwrap_or(""))
}

/// The bytes [`plain_kind`] stops at outside strings.
const KIND_SCAN: [bool; 256] = {
    let mut table = [false; 256];
    let mut k = 0;
    while k < 6 {
        table[b"\"{}[],"[k] as usize] = true;
        k += 1;
    }
    table
};

fn is_blank(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r' | b'\n')
}

/// The index of the quote that ends the string whose contents start at `start`, and whether
/// the string holds an escape; `None` if it does not end.
fn string_end(b: &[u8], mut start: usize) -> Option<(usize, bool)> {
    let mut escaped = false;
    loop {
        let at = start + memchr::memchr2(b'"', b'\\', b.get(start..)?)?;
        if b[at] == b'"' {
            return Some((at, escaped));
        }
        escaped = true;
        start = at + 2;
    }
}

fn name_of_json(meta: &RawValue) -> String {
    name_of(
        serde_json::from_str::<serde_json::Value>(meta.get())
            .ok()
            .as_ref(),
    )
}

/// The fields of a JSON object that decide what it is.
struct JsonEnvelope;

struct Envelope<'de> {
    kind: Option<String>,
    metadata: Option<&'de RawValue>,
    /// A list's items (`items` is an array).
    items: Option<Vec<&'de RawValue>>,
}

/// Map keys that matter, recognised without allocating.
enum Key {
    Kind,
    Metadata,
    Items,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "kind" => Key::Kind,
                    "metadata" => Key::Metadata,
                    "items" => Key::Items,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

impl<'de> Visitor<'de> for JsonEnvelope {
    type Value = Envelope<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Envelope<'de>, A::Error> {
        let mut envelope = Envelope {
            kind: None,
            metadata: None,
            items: None,
        };
        // A repeated `kind` or `metadata`: the last one counts, as in a generic tree.
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Kind => {
                    let kind: &RawValue = map.next_value()?;
                    envelope.kind = serde_json::from_str::<String>(kind.get()).ok();
                }
                Key::Metadata => envelope.metadata = Some(map.next_value()?),
                Key::Items => {
                    // A later `items` that is no array does not undo the list.
                    if let Some(items) = map.next_value_seed(JsonItems)? {
                        envelope.items.get_or_insert_default().extend(items);
                    }
                }
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(envelope)
    }
}

/// A top-level JSON value: an object's envelope, nothing for any other value.
struct TopLevel<'de>(Option<Envelope<'de>>);

impl<'de> de::Deserialize<'de> for TopLevel<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TopLevelVisitor)
    }
}

struct TopLevelVisitor;

impl<'de> Visitor<'de> for TopLevelVisitor {
    type Value = TopLevel<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any value")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        JsonEnvelope.visit_map(map).map(|e| TopLevel(Some(e)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(TopLevel(None))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(TopLevel(None))
    }
}

/// A JSON `items` value: its elements' slices if it is an array (read in the same pass as the
/// object around it), `None` if it is anything else.
struct JsonItems;

impl<'de> DeserializeSeed<'de> for JsonItems {
    type Value = Option<Vec<&'de RawValue>>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for JsonItems {
    type Value = Option<Vec<&'de RawValue>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<&'de RawValue>()? {
            items.push(item);
        }
        Ok(Some(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Map, Value};

    /// Keys and strings that a scan could get wrong.
    const WORDS: &[&str] = &[
        "kind",
        "items",
        "Service",
        "a",
        "ki\"nd",
        "k\\ind",
        "\"kind\": \"x\"",
        "é",
        "",
    ];

    fn value() -> impl Strategy<Value = Value> {
        let word = || proptest::sample::select(WORDS).prop_map(String::from);
        let leaf = prop_oneof![
            word().prop_map(Value::String),
            any::<i32>().prop_map(Value::from),
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
        ];
        leaf.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec((word(), inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
            ]
        })
    }

    fn needs_escape(s: &str) -> bool {
        s.contains(['"', '\\'])
    }

    proptest! {
        /// The scan answers exactly when the answer is plain, and then as the envelope reader.
        #[test]
        fn the_kind_scan_agrees_with_the_envelope_reader(
            fields in proptest::collection::vec(
                (proptest::sample::select(WORDS).prop_map(String::from), value()), 0..6),
            pretty in any::<bool>(),
        ) {
            let object: Map<String, Value> = fields.into_iter().collect();
            let plain = !object.contains_key("items")
                && !object.keys().any(|k| needs_escape(k))
                && object.get("kind").is_none_or(|k| k.as_str().is_some_and(|k| !needs_escape(k)));
            let object = Value::Object(object);
            let text = match pretty {
                true => serde_json::to_string_pretty(&object).unwrap(),
                false => object.to_string(),
            };
            let scanned = plain_kind(&text);
            prop_assert_eq!(scanned.is_some(), plain, "{}", text);
            if let Some(kind) = scanned {
                let mut de = serde_json::Deserializer::from_str(&text);
                let envelope = (&mut de).deserialize_map(JsonEnvelope).unwrap();
                prop_assert!(envelope.items.is_none());
                prop_assert_eq!(envelope.kind.unwrap_or_default(), kind);
            }
        }
    }

    #[test]
    fn the_kind_scan_reads_only_the_top_level() {
        let text = r#"{"spec": {"kind": "Node", "items": []}, "a": ["kind", {"items": 1}],
            "s": "\"kind\": \"Node\"", "kind" :
              "Service", "z": "\\"}"#;
        assert_eq!(plain_kind(text), Some("Service"));
        assert_eq!(plain_kind(r#"{"a": 1}"#), Some(""));
        // Left to the envelope reader.
        for text in [
            r#"{"kind": "Node", "items": []}"#,
            r#"{"kind": "Node", "kind": "Service"}"#,
            r#"{"kind": "No\u0064e"}"#,
            r#"{"ki\u006ed": "Node"}"#,
            r#"{"kind": 1}"#,
            r#"["kind", "Node"]"#,
        ] {
            assert_eq!(plain_kind(text), None, "{text}");
        }
    }
}
