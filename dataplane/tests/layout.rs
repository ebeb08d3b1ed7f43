//! The workspace layout, checked so that it cannot rot (issue 21):
//! * no import cycle between the modules of `dataplane` (a top-level module, or `nft::X`) or of
//!   the agent (a top-level module);
//! * the backend-neutral part of `dataplane` does not depend on the nftables backend beyond the
//!   uses listed in [`NFT_USERS`], and `nft` does not depend on `iptables`;
//! * no `.rs` file is above [`MAX_LINES`] lines unless [`LONG_FILES`] says why.
//!
//! It reads the sources as text: comments and string literals are blanked, test-only code
//! (items under `#[cfg(test)]`, `tests.rs` files) is left out, and `crate::`, `super::` and
//! `self::` paths (with their `{…}` groups) are resolved to modules.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 800;

/// Files allowed above [`MAX_LINES`], each with the reason. An entry whose file is gone or has
/// become short fails the check too, so that the list only ever shrinks.
const LONG_FILES: &[(&str, &str)] = &[];

/// The backend-neutral `dataplane` modules that may use nftables-only modules, and which.
/// Everything else outside `nft` (model, net, settings, input, convert, tracker, topology,
/// conflicts, decision, iptables) imports nothing from `nft`.
const NFT_USERS: &[(&str, &[&str], &str)] = &[
    (
        "conntrack",
        &["nft::ruleset", "nft::state"],
        "the UDP frontends are read from the committed nftables table \
         (`Frontends::from_table_state`)",
    ),
    (
        "trace",
        &["nft::ruleset"],
        "the packet tracer walks the nftables ruleset model",
    ),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("dataplane sits in the workspace")
        .to_path_buf()
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" {
                rs_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    out.sort();
}

/// `text` with comments and the contents of string and character literals replaced by spaces
/// (newlines kept, so that line numbers stay).
fn blank_comments_and_strings(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        let start = i;
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            blank(&mut out, start, i);
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            blank(&mut out, start, i);
        } else if (b[i] == b'r' || b[i..].starts_with(b"br")) && (i == 0 || !ident(b[i - 1])) && {
            let mut j = i + if b[i] == b'b' { 2 } else { 1 };
            while j < b.len() && b[j] == b'#' {
                j += 1;
            }
            j < b.len() && b[j] == b'"'
        } {
            i += if b[i] == b'b' { 2 } else { 1 };
            let mut hashes = 0;
            while b[i] == b'#' {
                hashes += 1;
                i += 1;
            }
            i += 1;
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            while i < b.len() && !b[i..].starts_with(&close) {
                i += 1;
            }
            i = (i + close.len()).min(b.len());
            blank(&mut out, start, i);
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
            blank(&mut out, start, i);
        } else if b[i] == b'\'' {
            // A character literal ('x', '\n', '\''), or a lifetime ('a), left alone.
            if b.get(i + 1) == Some(&b'\\') {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                blank(&mut out, start, i.min(b.len()));
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
                blank(&mut out, start, i);
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Path, // `::`
    Open,
    Close,
    Comma,
    Semi,
    Hash,
    LBracket,
    RBracket,
    Other,
}

fn tokens(text: &str) -> Vec<Tok> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(text[start..i].to_string()));
            continue;
        }
        i += 1;
        out.push(match c {
            b':' if b.get(i) == Some(&b':') => {
                i += 1;
                Tok::Path
            }
            b'{' => Tok::Open,
            b'}' => Tok::Close,
            b',' => Tok::Comma,
            b';' => Tok::Semi,
            b'#' => Tok::Hash,
            b'[' => Tok::LBracket,
            b']' => Tok::RBracket,
            c if c.is_ascii_whitespace() => continue,
            _ => Tok::Other,
        });
    }
    out
}

/// Removes the items under `#[cfg(test)]` (the attribute, any further attributes, and the item
/// up to its `;` or its closing brace); returns the `mod` names so declared.
fn drop_test_items(toks: Vec<Tok>) -> (Vec<Tok>, Vec<String>) {
    let is_cfg_test = |t: &[Tok]| {
        matches!(t, [Tok::Hash, Tok::LBracket, Tok::Ident(cfg), Tok::Other, Tok::Ident(test), Tok::Other, Tok::RBracket, ..]
            if cfg == "cfg" && test == "test")
    };
    let mut out = Vec::new();
    let mut test_mods = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if !is_cfg_test(&toks[i..]) {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        i += 7;
        // Further attributes: `#[…]`.
        while toks.get(i) == Some(&Tok::Hash) && toks.get(i + 1) == Some(&Tok::LBracket) {
            let mut depth = 0;
            i += 1;
            while i < toks.len() {
                match toks[i] {
                    Tok::LBracket => depth += 1,
                    Tok::RBracket => depth -= 1,
                    _ => {}
                }
                i += 1;
                if depth == 0 {
                    break;
                }
            }
        }
        // `[pub] mod NAME;`: a test-only module file (under `#[path]`, it is found by its
        // name ending in `tests.rs` instead).
        let head = toks[i..]
            .iter()
            .take_while(|t| !matches!(t, Tok::Open | Tok::Semi));
        let head: Vec<&Tok> = head.collect();
        if let Some(w) = head.windows(2).find(|w| *w[0] == Tok::Ident("mod".into()))
            && let Tok::Ident(name) = w[1]
        {
            test_mods.push(name.clone());
        }
        let mut depth = 0;
        while i < toks.len() {
            match toks[i] {
                Tok::Open => depth += 1,
                Tok::Close => {
                    depth -= 1;
                    if depth == 0 {
                        i += 1;
                        break;
                    }
                }
                Tok::Semi if depth == 0 => {
                    i += 1;
                    break;
                }
                _ => {}
            }
            i += 1;
        }
    }
    (out, test_mods)
}

/// Every path of a `use` tree or expression path starting at `toks[i]` (after the leading
/// `crate`/`super`/`self` segments are taken off by the caller), joined onto `prefix`.
fn path_tree(toks: &[Tok], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix;
    loop {
        match toks.get(i) {
            Some(Tok::Ident(s)) => {
                if s != "self" {
                    path.push(s.clone());
                }
                i += 1;
                if toks.get(i) == Some(&Tok::Path) {
                    i += 1;
                    continue;
                }
                out.push(path);
                return i;
            }
            Some(Tok::Open) => {
                i += 1;
                loop {
                    match toks.get(i) {
                        Some(Tok::Close) => return i + 1,
                        Some(Tok::Comma) => i += 1,
                        None => return i,
                        _ => {
                            let before = i;
                            i = path_tree(toks, i, path.clone(), out);
                            // Skip `as x` and anything else up to the next `,` or `}`.
                            while !matches!(toks.get(i), Some(Tok::Comma | Tok::Close) | None) {
                                i += 1;
                            }
                            if i == before {
                                i += 1;
                            }
                        }
                    }
                }
            }
            _ => {
                out.push(path);
                return i;
            }
        }
    }
}

/// The module paths (from the crate root) that a file of module `module` refers to.
fn referenced(toks: &[Tok], module: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // Inline modules: (brace depth inside them, name).
    let mut inline: Vec<(usize, String)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Open => depth += 1,
            Tok::Close => {
                if inline.last().is_some_and(|(d, _)| *d == depth) {
                    inline.pop();
                }
                depth -= 1;
            }
            Tok::Ident(m) if m == "mod" => {
                if let (Some(Tok::Ident(name)), Some(Tok::Open)) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((depth + 1, name.clone()));
                }
            }
            Tok::Ident(first)
                if (first == "crate" || first == "super" || first == "self")
                    && (i == 0 || toks[i - 1] != Tok::Path)
                    && toks.get(i + 1) == Some(&Tok::Path) =>
            {
                let mut base: Vec<String> = module.to_vec();
                base.extend(inline.iter().map(|(_, n)| n.clone()));
                if first == "crate" {
                    base.clear();
                }
                let mut j = i;
                if first != "crate" {
                    while let Some(Tok::Ident(s)) = toks.get(j) {
                        if s == "super" && toks.get(j + 1) == Some(&Tok::Path) {
                            base.pop();
                            j += 2;
                        } else if s == "self" && toks.get(j + 1) == Some(&Tok::Path) {
                            j += 2;
                        } else {
                            break;
                        }
                    }
                } else {
                    j += 2;
                }
                i = path_tree(toks, j, base, &mut out);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// A crate's modules: for each unit (see `unit`), the units it imports.
fn import_graph(
    src: &Path,
    unit: fn(&[String]) -> Option<String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rs_files(src, &mut files);
    let mut test_only: BTreeSet<PathBuf> = BTreeSet::new();
    let mut parsed = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(src).unwrap();
        let name = rel.file_name().unwrap().to_string_lossy().into_owned();
        let mut module: Vec<String> = rel
            .with_extension("")
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        let is_dir_module = ["mod.rs", "lib.rs", "main.rs"].contains(&name.as_str());
        if is_dir_module {
            module.pop();
        }
        let text = fs::read_to_string(file).unwrap();
        let (toks, test_mods) = drop_test_items(tokens(&blank_comments_and_strings(&text)));
        let children = if is_dir_module {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        for m in test_mods {
            test_only.insert(children.join(format!("{m}.rs")));
            test_only.insert(children.join(&m).join("mod.rs"));
        }
        parsed.push((file.clone(), name, module, toks));
    }
    let units: BTreeSet<String> = parsed.iter().filter_map(|(_, _, m, _)| unit(m)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, name, module, toks) in parsed {
        // The crate roots only declare modules; the binary's main.rs is another crate.
        if name == "lib.rs" || name == "main.rs" || name.ends_with("tests.rs") {
            continue;
        }
        if test_only.contains(&file) {
            continue;
        }
        let Some(from) = unit(&module) else { continue };
        for path in referenced(&toks, &module) {
            if let Some(to) = unit(&path)
                && to != from
                && units.contains(&to)
                && !from.starts_with(&format!("{to}::"))
            {
                graph.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    graph
}

/// One cycle through each strongly connected set of modules, if any.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut found: Vec<Vec<String>> = Vec::new();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    for start in graph.keys() {
        if covered.contains(start) {
            continue;
        }
        // Shortest path from each successor back to `start` (breadth first).
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start.clone()]);
        let mut seen = BTreeSet::from([start.clone()]);
        let mut closing = None;
        while let Some(n) = queue.pop_front() {
            for next in graph.get(&n).into_iter().flatten() {
                if next == start {
                    closing = Some(n.clone());
                    break;
                }
                if seen.insert(next.clone()) {
                    prev.insert(next.clone(), n.clone());
                    queue.push_back(next.clone());
                }
            }
            if closing.is_some() {
                break;
            }
        }
        if let Some(mut n) = closing {
            let mut cycle = vec![start.clone()];
            let mut back = vec![n.clone()];
            while let Some(p) = prev.get(&n) {
                back.push(p.clone());
                n = p.clone();
            }
            back.pop(); // `start` itself
            back.reverse();
            cycle.extend(back);
            cycle.push(start.clone());
            covered.extend(cycle.iter().cloned());
            found.push(cycle);
        }
    }
    found
}

fn dataplane_unit(path: &[String]) -> Option<String> {
    match path {
        [] => None,
        [nft, sub, ..] if nft == "nft" => Some(format!("nft::{sub}")),
        [first, ..] => Some(first.clone()),
    }
}

fn top_level_unit(path: &[String]) -> Option<String> {
    path.first().cloned()
}

fn cycle_report(krate: &str, graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    cycles(graph)
        .into_iter()
        .map(|c| {
            format!(
                "import cycle in {krate}: {}. Make the imports flow one way: move what both \
                 sides need into one of them or into a lower module (see the layout in \
                 docs/architecture.md).",
                c.join(" -> ")
            )
        })
        .collect()
}

#[test]
fn no_import_cycles_between_modules() {
    let root = workspace();
    let mut problems = cycle_report(
        "dataplane",
        &import_graph(&root.join("dataplane/src"), dataplane_unit),
    );
    problems.extend(cycle_report(
        "the agent",
        &import_graph(&root.join("agent/src"), top_level_unit),
    ));
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn the_backend_neutral_dataplane_does_not_depend_on_nftables() {
    let graph = import_graph(&workspace().join("dataplane/src"), dataplane_unit);
    let mut problems = Vec::new();
    for (from, tos) in &graph {
        let nft_side = from == "nft" || from.starts_with("nft::");
        for to in tos {
            let allowed = NFT_USERS
                .iter()
                .any(|(user, uses, _)| user == from && uses.contains(&to.as_str()));
            if !nft_side && to.starts_with("nft") && !allowed {
                problems.push(format!(
                    "dataplane::{from} imports dataplane::{to}, but only the nftables backend \
                     (dataplane::nft) and the users listed in NFT_USERS may. Move what {from} \
                     needs into a backend-neutral module (net, model, settings), or move the \
                     code into nft/; if the dependency is intended, add it to NFT_USERS in \
                     dataplane/tests/layout.rs with the reason."
                ));
            }
            if nft_side && to == "iptables" {
                problems.push(format!(
                    "dataplane::{from} imports dataplane::iptables: one backend must not depend \
                     on the other. Move what both need into a backend-neutral module."
                ));
            }
        }
    }
    // The list itself stays true: every allowed use still happens.
    for (user, uses, _) in NFT_USERS {
        for u in *uses {
            if !graph.get(*user).is_some_and(|t| t.contains(*u)) {
                problems.push(format!(
                    "NFT_USERS in dataplane/tests/layout.rs allows dataplane::{user} to import \
                     dataplane::{u}, which it no longer does: remove the entry."
                ));
            }
        }
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

#[test]
fn no_source_file_is_longer_than_the_limit() {
    let root = workspace();
    let mut files = Vec::new();
    rs_files(&root, &mut files);
    let mut problems = Vec::new();
    let mut long = BTreeSet::new();
    for file in &files {
        let rel = file
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let lines = fs::read_to_string(file).unwrap().lines().count();
        if lines <= MAX_LINES {
            continue;
        }
        long.insert(rel.clone());
        if !LONG_FILES.iter().any(|(f, _)| *f == rel) {
            problems.push(format!(
                "{rel} has {lines} lines (limit {MAX_LINES}): split it by concept into \
                 submodules (unit tests into a `tests.rs`, an integration suite's helpers into \
                 modules of `tests/<suite>/`), or, if one concept really needs the length, add it \
                 to LONG_FILES in dataplane/tests/layout.rs with the reason."
            ));
        }
    }
    for (f, _) in LONG_FILES {
        if !long.contains(*f) {
            problems.push(format!(
                "{f} is listed in LONG_FILES (dataplane/tests/layout.rs) but is gone or no longer \
                 above {MAX_LINES} lines: remove the entry."
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
}

/// The parser itself: a cycle planted in sources is found, comments, strings and test code
/// are not read as imports, and `super`/`self`/groups resolve.
#[test]
fn the_checker_reads_imports_as_the_compiler_does() {
    let toks = |s: &str| drop_test_items(tokens(&blank_comments_and_strings(s)));
    let module = |m: &str| m.split("::").map(String::from).collect::<Vec<_>>();
    let (t, test_mods) = toks(
        "use crate::nft::{ruleset::{Key, Proto}, state};\n\
         use super::super::model::Service; // crate::fake\n\
         /* crate::other */ const S: &str = \"crate::in_string\";\n\
         fn f() { let c = '\"'; crate::topology::pick(); }\n\
         mod inner { use super::super::super::settings::X; }\n\
         #[cfg(test)]\nmod tests { use crate::iptables; }\n\
         #[cfg(test)]\n#[path = \"x.rs\"]\nmod helper;\n\
         #[cfg(test)]\nfn only_in_tests() { crate::decision::f(); }\n\
         use self::child::Y;\n",
    );
    assert_eq!(test_mods, ["tests", "helper"]);
    let units: BTreeSet<String> = referenced(&t, &module("nft::plan"))
        .iter()
        .filter_map(|p| dataplane_unit(p))
        .collect();
    let want = [
        "model",
        "nft::plan",
        "nft::ruleset",
        "nft::state",
        "settings",
        "topology",
    ];
    assert_eq!(units, want.iter().map(|s| s.to_string()).collect());

    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a", "d"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(cycles(&graph), vec![vec!["a", "b", "c", "a"]]);
}
