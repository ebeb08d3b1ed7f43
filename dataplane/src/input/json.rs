//! The JSON fast path: a stream of JSON values is checked in one pass, split into units (each
//! value, or a large list's items), and each unit is typed straight from its own slice.

use serde::Deserializer as _;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{Object, Outcome, name_of, typed};

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
        |kind| {
            Some(match kind {
                "Service" => serde_json::from_str(text).map(Object::Service),
                "EndpointSlice" => serde_json::from_str(text).map(Object::Slice),
                "Node" => serde_json::from_str(text).map(Object::Node),
                "ServiceCIDR" => serde_json::from_str(text).map(Object::ServiceCidr),
                _ => return None,
            })
        },
    ));
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
