//! YAML files built from the generated objects: layouts, random edits of the text, and YAML's
//! own traps.

use super::*;

/// How documents are put together into one file.
#[derive(Clone, Debug)]
pub enum Layout {
    /// `---`-separated documents.
    Stream,
    /// One `kind: List` document.
    List,
    /// Lists nested inside lists.
    NestedLists,
    /// JSON text (YAML accepts it).
    Json,
}

/// An edit of a text: where (a fraction of its length) and what.
#[derive(Clone, Debug)]
pub enum Edit {
    Insert(f64, String),
    Delete(f64, usize),
    Duplicate(f64, usize),
    Truncate(f64),
    Replace(f64, char),
}

pub fn edit() -> BoxedStrategy<Edit> {
    let snippet = prop_oneof![
        select(vec![
            "\n",
            "---\n",
            "...\n",
            ":",
            ": ",
            "- ",
            "[",
            "]",
            "{",
            "}",
            "\"",
            "'",
            "&a ",
            "*a",
            "<<: *a\n",
            "!!str ",
            "!!binary ",
            "!custom ",
            "#",
            "\t",
            "\r\n",
            "\u{0}",
            "\u{feff}",
            "%YAML 1.2\n",
            "? ",
            "|\n",
            ">-\n",
            "  ",
            "kind: List\nitems:\n",
            "99999999999999999999999999",
            "-0",
            ".nan",
            ".inf",
            "0x7fffffff",
            "1e400",
        ])
        .prop_map(str::to_string),
        weird_string(),
    ];
    prop_oneof![
        3 => (0.0..1.0f64, snippet).prop_map(|(at, s)| Edit::Insert(at, s)),
        2 => (0.0..1.0f64, 1usize..40).prop_map(|(at, n)| Edit::Delete(at, n)),
        1 => (0.0..1.0f64, 1usize..200).prop_map(|(at, n)| Edit::Duplicate(at, n)),
        1 => (0.0..1.0f64).prop_map(Edit::Truncate),
        2 => (0.0..1.0f64, any::<char>()).prop_map(|(at, c)| Edit::Replace(at, c)),
    ]
    .boxed()
}

/// The char boundary nearest below `fraction` of `text`.
pub(super) fn boundary(text: &str, fraction: f64) -> usize {
    let mut at = ((text.len() as f64) * fraction) as usize;
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

pub fn apply_edits(text: &mut String, edits: &[Edit]) {
    for e in edits {
        match e {
            Edit::Insert(at, s) => {
                let at = boundary(text, *at);
                text.insert_str(at, s);
            }
            Edit::Delete(at, n) => {
                let from = boundary(text, *at);
                let to = boundary(
                    text,
                    ((from + n) as f64 / text.len().max(1) as f64).min(1.0),
                );
                if to > from {
                    text.replace_range(from..to, "");
                }
            }
            Edit::Duplicate(at, n) => {
                let from = boundary(text, *at);
                let to = boundary(
                    text,
                    ((from + n) as f64 / text.len().max(1) as f64).min(1.0),
                );
                if to > from {
                    let copy = text[from..to].to_string();
                    text.insert_str(to, &copy);
                }
            }
            Edit::Truncate(at) => {
                let at = boundary(text, *at);
                text.truncate(at);
            }
            Edit::Replace(at, c) => {
                let at = boundary(text, *at);
                if let Some(old) = text[at..].chars().next() {
                    text.replace_range(at..at + old.len_utf8(), &c.to_string());
                }
            }
        }
    }
}

/// The text of `objects` laid out as `layout`.
pub fn render(objects: &[Value], layout: &Layout) -> String {
    let yaml = |v: &Value| serde_yaml_ng::to_string(v).unwrap_or_default();
    let list = |items: &[Value]| json!({"apiVersion": "v1", "kind": "List", "items": items});
    match layout {
        Layout::Stream => objects.iter().map(yaml).collect::<Vec<_>>().join("---\n"),
        Layout::List => yaml(&list(objects)),
        Layout::NestedLists => {
            let half = objects.len() / 2;
            let inner = list(&objects[half..]);
            let mut items = objects[..half].to_vec();
            items.push(inner);
            yaml(&list(&items))
        }
        Layout::Json => serde_json::to_string_pretty(&list(objects)).unwrap_or_default(),
    }
}

/// A file of Kubernetes objects: generated objects laid out one way or another, then edited.
#[derive(Clone, Debug)]
pub struct YamlFile {
    pub objects: Vec<Value>,
    pub layout: Layout,
    pub edits: Vec<Edit>,
}

impl YamlFile {
    pub fn text(&self) -> String {
        let mut text = render(&self.objects, &self.layout);
        apply_edits(&mut text, &self.edits);
        text
    }
}

pub fn yaml_file(max_objects: usize) -> BoxedStrategy<YamlFile> {
    let layout = prop_oneof![
        Just(Layout::Stream),
        Just(Layout::List),
        Just(Layout::NestedLists),
        Just(Layout::Json),
    ];
    let edits = prop_oneof![
        2 => Just(Vec::new()),
        3 => vec(edit(), 1..6),
    ];
    (vec(any_object(), 0..max_objects), layout, edits)
        .prop_map(|(objects, layout, edits)| YamlFile {
            objects,
            layout,
            edits,
        })
        .boxed()
}

/// YAML's own traps, each parameterised by a size.
pub fn yaml_trap() -> BoxedStrategy<String> {
    let n = 1usize..400;
    prop_oneof![
        // Deep flow and block nesting.
        n.clone().prop_map(|n| format!("{}1{}", "[".repeat(n), "]".repeat(n))),
        n.clone().prop_map(|n| format!("{}1{}", "{a: ".repeat(n), "}".repeat(n))),
        n.clone().prop_map(|n| {
            (0..n).map(|i| format!("{}- \n", " ".repeat(i * 2))).collect::<String>()
        }),
        n.clone().prop_map(|n| format!("kind: List\nitems:\n{}", "- kind: List\n  items:\n".repeat(n))),
        // Unbalanced nesting.
        n.clone().prop_map(|n| "[{".repeat(n)),
        // Alias expansion ("billion laughs").
        (1usize..12, 2usize..10).prop_map(|(levels, width)| {
            let mut s = String::from("a0: &a0 [x]\n");
            for l in 1..=levels {
                let refs = vec![format!("*a{}", l - 1); width].join(", ");
                s.push_str(&format!("a{l}: &a{l} [{refs}]\n"));
            }
            s.push_str(&format!("kind: Service\nspec: {{ports: *a{levels}}}\n"));
            s
        }),
        // Merge keys, also recursive and of the wrong kind.
        Just("base: &b {kind: Service, metadata: {name: x}}\n<<: *b\nspec: {<<: [*b, *b]}\n".to_string()),
        Just("a: &a [1]\n<<: *a\n".to_string()),
        Just("a: &a\n  <<: *a\n".to_string()),
        Just("*undefined\n".to_string()),
        // Tags and scalars of every sort where objects are expected.
        Just("!!binary aGVsbG8=\n".to_string()),
        Just("kind: !!binary aGVsbG8=\n".to_string()),
        Just("kind: Service\nmetadata: {name: !!int 1}\nspec: {ports: [{port: !!float .nan}]}\n".to_string()),
        Just("kind: Service\nspec: {ports: [{port: 0x50}, {port: 0o120}, {port: +80}, {port: 8_0}]}\n".to_string()),
        Just("kind: Service\nspec: {ports: [{port: 99999999999999999999999999999999}]}\n".to_string()),
        Just("? [a, b]\n: c\n? {a: b}\n: d\n".to_string()),
        Just("%YAML 1.2\n%TAG ! tag:x,2000:\n---\n!foo {kind: Service}\n...\n---\n".to_string()),
        // Many empty documents.
        n.clone().prop_map(|n| "---\n".repeat(n)),
        n.prop_map(|n| "...\n---\n~\n".repeat(n)),
    ]
    .boxed()
}
