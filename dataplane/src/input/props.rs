//! The strict reader and the split agree with serde_yaml_ng on everything they accept, and
//! the whole file reader hands over what serde_yaml_ng alone would, error included.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{Value, json};

use super::block::{self, Unsure};
use super::*;

/// Strings that YAML reads in surprising ways.
const TRICKY: &[&str] = &[
    "",
    " ",
    "a",
    "- a",
    "-",
    "--- x",
    "---",
    "...",
    "a: b",
    "a:b",
    "#x",
    "x #y",
    "x#y",
    "10.96.0.1",
    "fd00::1",
    "fd00::",
    "0123",
    "0",
    "-0",
    "12",
    "-12",
    "1.5",
    ".5",
    "1e3",
    "1_000",
    "0x1f",
    "+1",
    "99999999999999999999",
    "true",
    "True",
    "yes",
    "null",
    "~",
    "NULL",
    ".inf",
    "-.inf",
    "nan",
    "lead ",
    " trail",
    "it's",
    "say \"hi\"",
    "back\\slash",
    "a\nb",
    "- x\n--- y\n",
    "line\n",
    "two\n\n",
    "\n",
    "é",
    "日本",
    "tab\there",
    "[a]",
    "{a: 1}",
    "&a",
    "*a",
    "!t",
    "%x",
    "@x",
    "`x",
    "|",
    ">",
    "?",
    "a, b",
    "@",
    "k: [x",
    "-1",
    "- ",
    "items",
];

const KEYS: &[&str] = &[
    "kind",
    "metadata",
    "name",
    "items",
    "a-b",
    "a.b/c",
    "x_y",
    "80",
    "true",
    "null",
    "with space",
    "x:y",
    "-k",
    "_k",
    "Key",
];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        select(TRICKY).prop_map(|s| Value::String(s.to_string())),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        any::<bool>().prop_map(Value::Bool),
        Just(Value::Null),
    ]
}

fn tree() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((select(KEYS), inner), 0..5).prop_map(|entries| {
                Value::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect(),
                )
            }),
        ]
    })
}

/// Emits YAML for a value in styles chosen by `style` (consumed a bit per node): block or
/// flow collections, plain, single-, double-quoted or literal block scalars, comments.
struct Emitter<'a> {
    style: &'a [u8],
    at: usize,
    out: String,
}

impl Emitter<'_> {
    fn pick(&mut self, n: u8) -> u8 {
        let b = self
            .style
            .get(self.at % self.style.len().max(1))
            .copied()
            .unwrap_or(0);
        self.at += 1;
        b % n
    }

    fn scalar(&mut self, v: &Value, flow: bool) -> String {
        match v {
            Value::String(s) => match self.pick(if flow || s.contains('\n') { 3 } else { 4 }) {
                0 => serde_json::to_string(s).unwrap(),
                1 => format!("'{}'", s.replace('\'', "''")),
                2 if !flow && s.contains('\n') => {
                    // A literal block scalar is written by `block`; here: double-quoted.
                    serde_json::to_string(s).unwrap()
                }
                _ => s.clone(),
            },
            Value::Array(a) => {
                let items: Vec<String> = a.iter().map(|v| self.scalar(v, true)).collect();
                format!("[{}]", items.join(", "))
            }
            Value::Object(m) => {
                let entries: Vec<String> = m
                    .iter()
                    .map(|(k, v)| format!("{}: {}", self.key(k), self.scalar(v, true)))
                    .collect();
                format!("{{{}}}", entries.join(", "))
            }
            other => other.to_string(),
        }
    }

    fn key(&mut self, k: &str) -> String {
        match self.pick(4) {
            0 => serde_json::to_string(k).unwrap(),
            1 => format!("'{k}'"),
            _ => k.to_string(),
        }
    }

    fn comment(&mut self) -> &'static str {
        match self.pick(6) {
            0 => " # note: - x",
            1 => " #",
            _ => "",
        }
    }

    /// A value after `key:` or `- ` at `indent`: on the same line, or on the lines below.
    fn block(&mut self, v: &Value, indent: usize) {
        let pad = " ".repeat(indent);
        match v {
            Value::Object(m) if !m.is_empty() && self.pick(5) != 0 => {
                let c = self.comment();
                self.out.push_str(c);
                self.out.push('\n');
                for (k, v) in m {
                    if self.pick(8) == 0 {
                        self.out.push_str(&format!("{pad}# a comment: - x\n"));
                    }
                    let k = self.key(k);
                    self.out.push_str(&format!("{pad}{k}:"));
                    self.block(v, indent + 2);
                }
            }
            Value::Array(a) if !a.is_empty() && self.pick(5) != 0 => {
                let c = self.comment();
                self.out.push_str(c);
                self.out.push('\n');
                // kubectl's compact form (`- ` at the key's column) or indented.
                let pad = if self.pick(2) == 0 && indent >= 2 {
                    " ".repeat(indent - 2)
                } else {
                    pad
                };
                for v in a {
                    self.out.push_str(&format!("{pad}-"));
                    self.block(v, pad.len() + 2);
                }
            }
            Value::String(s) if s.contains('\n') && self.pick(2) == 0 => {
                let chomp = if s.ends_with('\n') { "" } else { "-" };
                self.out.push_str(&format!(" |{chomp}\n"));
                for line in s.trim_end_matches('\n').split('\n') {
                    if line.is_empty() {
                        self.out.push('\n');
                    } else {
                        self.out.push_str(&format!("{pad}{line}\n"));
                    }
                }
            }
            v => {
                let s = self.scalar(v, false);
                let c = self.comment();
                self.out.push_str(&format!(" {s}{c}\n"));
            }
        }
    }

    fn document(&mut self, v: &Value) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, v) in m {
                    let k = self.key(k);
                    self.out.push_str(&format!("{k}:"));
                    self.block(v, 2);
                }
            }
            v => {
                let s = self.scalar(v, false);
                self.out.push_str(&format!("{s}\n"));
            }
        }
    }
}

fn emit(values: &[Value], style: &[u8], markers: bool) -> String {
    let mut e = Emitter {
        style,
        at: 0,
        out: String::new(),
    };
    for (i, v) in values.iter().enumerate() {
        if markers || i > 0 {
            e.out.push_str("---\n");
        }
        e.document(v);
    }
    e.out
}

/// What the reference (serde_yaml_ng alone) makes of a document.
fn reference_document(text: &str) -> Result<Value, String> {
    serde_yaml_ng::from_str::<Value>(text).map_err(|e| e.to_string())
}

/// Everything a reader hands over: objects, skipped objects, and the result.
type Handed = (Vec<Object>, Vec<Skipped>, Result<(), ParseError>);

fn with_fast_path(text: &str) -> Handed {
    let mut objects = Vec::new();
    let mut skipped = Vec::new();
    let result = for_each_object(text, &mut skipped, |o| objects.push(o));
    (objects, skipped, result)
}

fn reference_only(text: &str) -> Handed {
    let mut objects = Vec::new();
    let mut skipped = Vec::new();
    let mut f = |o| objects.push(o);
    let mut sink = Sink {
        skipped: &mut skipped,
        f: &mut f,
        handed: 0,
        skip: 0,
    };
    let result = read_yaml(text, &mut sink);
    (objects, skipped, result)
}

/// Kubernetes-like objects with tricky annotations and labels.
fn k8s_object() -> impl Strategy<Value = Value> {
    (
        select(&["Service", "Node", "ConfigMap", "EndpointSlice"][..]),
        0u32..5,
        vec((select(KEYS), select(TRICKY)), 0..3),
        proptest::option::of(tree()),
        any::<bool>(),
    )
        .prop_map(|(kind, n, annotations, extra, bad)| {
            let annotations: serde_json::Map<String, Value> = annotations
                .into_iter()
                .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
                .collect();
            let mut o = json!({
                "apiVersion": "v1", "kind": kind,
                "metadata": {"name": format!("o{n}"), "namespace": "ns",
                             "annotations": annotations, "labels": {"app": format!("a{n}")}},
            });
            match kind {
                "Service" => {
                    o["spec"] = json!({"clusterIP": format!("10.96.0.{n}"),
                                       "ports": [{"port": if bad { json!("x") } else { json!(80) },
                                                  "protocol": "TCP"}]});
                }
                "EndpointSlice" => {
                    o["addressType"] = json!("IPv4");
                    o["endpoints"] = json!([{"addresses": [format!("10.0.0.{n}")]}]);
                    o["ports"] = json!([{"port": 8080}]);
                }
                _ => {}
            }
            if let Some(extra) = extra {
                o["extra"] = extra;
            }
            o
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Whatever the strict reader accepts, serde_yaml_ng reads the same way.
    #[test]
    fn the_strict_reader_agrees_with_serde_yaml(v in tree(), style in vec(any::<u8>(), 1..64)) {
        let text = emit(std::slice::from_ref(&v), &style, false);
        match block::document(&text) {
            Err(Unsure) => {}
            Ok(fast) => {
                let reference = reference_document(&text);
                prop_assert_eq!(Ok(fast.unwrap_or(Value::Null)), reference, "{}", text);
            }
        }
    }

    /// Lists and document streams of objects: the same objects, skipped objects and result
    /// as serde_yaml_ng alone, also when the text is cut or damaged anywhere.
    #[test]
    fn every_file_reads_as_serde_yaml_reads_it(
        objects in vec(k8s_object(), 0..12),
        style in vec(any::<u8>(), 1..64),
        list in any::<bool>(),
        damage in proptest::option::of((any::<prop::sample::Index>(), select(&[
            "", "\"", "'", "\n- x", "\n---\n", "\t", "\r\n", "  ", "\n  ", ": ", "[", "|\n", "&a ",
            "*a", "\u{feff}", "\n...\n", "%YAML 1.2\n", "\n# c\n",
        ][..]), any::<bool>())),
    ) {
        let mut text = if list {
            emit(&[json!({"apiVersion": "v1", "items": objects, "kind": "List",
                          "metadata": {"resourceVersion": ""}})], &style, false)
        } else {
            emit(&objects, &style, style[0] % 2 == 0)
        };
        if let Some((at, insert, cut)) = damage {
            let mut i = at.index(text.len() + 1);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            if cut {
                text.truncate(i);
            }
            text.insert_str(i, insert);
        }
        let fast = with_fast_path(&text);
        let reference = reference_only(&text);
        prop_assert_eq!(&fast.0, &reference.0, "{}", text);
        prop_assert_eq!(&fast.1, &reference.1, "{}", text);
        prop_assert_eq!(&fast.2, &reference.2, "{}", text);
    }
}

#[test]
fn kubectl_output_takes_the_fast_path() {
    let list = json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
        "items": [{"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": "a", "namespace": "ns",
                                "annotations": {"note": "line one\nline two\n"}},
                   "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}]});
    let text = serde_yaml_ng::to_string(&list).unwrap();
    let units = split::units(&text).unwrap();
    assert_eq!(units.len(), 1, "{text}");
    assert!(matches!(units[0], split::Unit::Item { .. }));
    let value = units[0].read().unwrap().unwrap();
    assert_eq!(value, list["items"][0]);
    // Block scalars holding `- ` and `---` lines, comments, flow style.
    let text = "items:\n- kind: Node # c\n  metadata:\n    name: n\n    annotations:\n      \
                a: |\n        - x\n        ---\n\n        y\n      b: {c: [1, 'd']}\n# c\n\
                - kind: Node\n  metadata: {name: m}\nkind: List\n";
    let units = split::units(text).unwrap();
    assert_eq!(units.len(), 2);
    let first = units[0].read().unwrap().unwrap();
    assert_eq!(
        first["metadata"]["annotations"],
        json!({"a": "- x\n---\n\ny\n", "b": {"c": [1, "d"]}})
    );
    assert_eq!(with_fast_path(text), reference_only(text));
}

/// The properties above mean something only if the strict reader accepts much of what they
/// generate.
#[test]
fn the_strict_reader_accepts_most_generated_documents() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut accepted, mut files) = (0, 0);
    for _ in 0..300 {
        let v = tree().new_tree(&mut runner).unwrap().current();
        let style = vec(any::<u8>(), 1..64)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        accepted += usize::from(block::document(&emit(&[v], &style, false)).is_ok());
        let objects = vec(k8s_object(), 1..6)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let text = emit(&objects, &style, false);
        let units = split::units(&text).unwrap();
        files += usize::from(units.iter().all(|u| u.read().is_ok()));
    }
    assert!(accepted > 90, "{accepted} of 300 documents accepted");
    assert!(files > 60, "{files} of 300 files accepted");
}

/// Deep nesting is left to serde_yaml_ng (which refuses it) instead of exhausting the stack.
#[test]
fn deep_nesting_is_refused_not_overflowed() {
    let flow = format!("a: {}1{}\n", "[".repeat(20_000), "]".repeat(20_000));
    let mut block = String::new();
    for depth in 0..2_000 {
        block.push_str(&format!("{}k:\n", " ".repeat(depth)));
    }
    for text in [flow, block] {
        assert_eq!(block::document(&text), Err(Unsure));
        assert_eq!(with_fast_path(&text), reference_only(&text));
    }
}
