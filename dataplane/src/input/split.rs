//! Splits YAML text into pieces that can be read independently, and in parallel: documents
//! at their `---` lines, and a list document's top-level `items` block sequence at its
//! entries' `- ` lines. The split only looks at lines; it is right whenever every piece is
//! accepted by the strict reader (`block`), which accepts nothing that could hide such a line
//! inside a scalar. Otherwise the caller reads the text with serde_yaml_ng.

use super::block::{self, Unsure};
use serde_json::Value;

/// A piece of YAML text read on its own.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unit<'a> {
    /// A document: what its `---` line holds after the marker (if anything), and its lines.
    Document { marker: &'a str, text: &'a str },
    /// One entry of a list document's `items`: from its `-` (at column `indent`) to the next.
    Item { text: &'a str, indent: usize },
}

impl Unit<'_> {
    /// The unit's value, as serde_yaml_ng would read it: a document's (`None` if empty),
    /// or an item's.
    pub(crate) fn read(&self) -> Result<Option<Value>, Unsure> {
        match *self {
            Unit::Document { marker, text } => {
                let marker = marker.trim_matches(' ');
                if marker.is_empty() || marker.starts_with('#') {
                    return block::document(text);
                }
                let value = block::marker_content(marker)?;
                match block::document(text)? {
                    None => Ok(Some(value)),
                    Some(_) => Err(Unsure),
                }
            }
            Unit::Item { text, indent } => block::sequence_item(text, indent).map(Some),
        }
    }
}

/// The pieces of `text`, or `None` if it holds what the split does not handle (directives,
/// `...` document ends, carriage returns, a byte order mark): then serde_yaml_ng reads it.
pub(crate) fn units(text: &str) -> Option<Vec<Unit<'_>>> {
    if text.starts_with('\u{feff}') || text.contains('\r') {
        return None;
    }
    let mut units = Vec::new();
    // (marker content, start of the document's lines)
    let mut doc: (&str, usize) = ("", 0);
    let mut offset = 0;
    for line in lines(text) {
        // Most lines start with neither `%`, `.` nor `-`.
        if !line.starts_with(['%', '.', '-']) {
            offset += line.len();
            continue;
        }
        let body = line.trim_end_matches('\n');
        if body.starts_with('%') || body == "..." || body.starts_with("... ") {
            return None;
        }
        if body == "---" || body.starts_with("--- ") {
            document(&text[doc.1..offset], doc.0, &mut units);
            doc = (&body[3..], offset + line.len());
        }
        offset += line.len();
    }
    document(&text[doc.1..], doc.0, &mut units);
    Some(units)
}

/// Adds a document's units: its items if it is a list written the way kubectl writes one
/// (`items:` at column 0, then a block sequence), else the whole document.
fn document<'a>(text: &'a str, marker: &'a str, units: &mut Vec<Unit<'a>>) {
    let whole = Unit::Document { marker, text };
    match list_items(text, marker) {
        Some(items) => units.extend(items),
        None => units.push(whole),
    }
}

/// The lines of `text`, each with its `\n` (as `split_inclusive('\n')`, found with `memchr`:
/// the split reads every line of a file before the parallel reading starts).
pub(crate) fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', text.as_bytes())
        .map(|i| i + 1)
        .chain([text.len()]);
    ends.filter_map(move |end| {
        let line = (end > start).then(|| &text[start..end]);
        start = end;
        line
    })
}

fn is_content(line: &str) -> bool {
    let t = line.trim_start_matches(' ').trim_end_matches('\n');
    !(t.is_empty() || t.starts_with('#'))
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

fn is_entry(line: &str) -> bool {
    let t = line.trim_start_matches(' ').trim_end_matches('\n');
    t == "-" || t.starts_with("- ")
}

/// The items of a list document, or `None` if the document is not one in the expected shape
/// or anything around its items is unsure.
fn list_items<'a>(text: &'a str, marker: &str) -> Option<Vec<Unit<'a>>> {
    let marker = marker.trim_matches(' ');
    if !(marker.is_empty() || marker.starts_with('#')) {
        return None;
    }
    // The mapping starts at column 0.
    let first = lines(text).find(|l| is_content(l))?;
    if indent(first) != 0 {
        return None;
    }
    let mut offset = 0;
    let mut items_line = None;
    for line in lines(text) {
        let body = line.trim_end_matches('\n').trim_end_matches(' ');
        if body == "items:" || body.starts_with("items: #") {
            items_line = Some((offset, offset + line.len()));
            break;
        }
        offset += line.len();
    }
    let (before, block_start) = items_line?;
    // The block sequence: its entries' column, then its lines until one is less indented or
    // at that column without a `- `.
    let rest = &text[block_start..];
    let first = lines(rest).find(|l| is_content(l))?;
    if !is_entry(first) {
        return None;
    }
    let column = indent(first);
    let mut items = Vec::new();
    let mut start: Option<usize> = None;
    let mut offset = block_start;
    let mut end = text.len();
    for line in lines(rest) {
        // Most lines are indented beyond the entries: nothing to see.
        let deeper = line
            .as_bytes()
            .get(..=column)
            .is_some_and(|head| head.iter().all(|b| *b == b' '));
        if !deeper && is_content(line) {
            let i = indent(line);
            if i < column || (i == column && !is_entry(line)) {
                end = offset;
                break;
            }
            if i == column {
                if let Some(s) = start {
                    items.push(Unit::Item {
                        text: &text[s..offset],
                        indent: column,
                    });
                }
                start = Some(offset);
            }
        }
        offset += line.len();
    }
    let s = start?;
    items.push(Unit::Item {
        text: &text[s..end],
        indent: column,
    });
    // Everything but the items must be a mapping without another `items`.
    let envelope = format!("{}{}", &text[..before], &text[end..]);
    match block::document(&envelope) {
        Ok(None) => {}
        Ok(Some(Value::Object(map))) if !map.contains_key("items") => {}
        _ => return None,
    }
    // An item's `- ` line at `column`: the text starts at the `-`.
    for item in &mut items {
        if let Unit::Item { text, .. } = item {
            *text = &text[column..];
        }
    }
    Some(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_as_split_inclusive_splits_them() {
        for text in [
            "",
            "\n",
            "\n\n",
            "a",
            "a\n",
            "a\nb",
            "a\n\nb\n",
            "é\n- x: y\n  z\n",
        ] {
            let want: Vec<&str> = text.split_inclusive('\n').collect();
            assert_eq!(lines(text).collect::<Vec<_>>(), want, "{text:?}");
        }
    }
}
