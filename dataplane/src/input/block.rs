//! A strict reader for the block YAML that `kubectl get -o yaml` writes: block mappings and
//! sequences, one-line plain, single- and double-quoted scalars, one-line flow collections,
//! literal block scalars (`|`, `|-`) and comments. It reads a value exactly as serde_yaml_ng
//! reads it into a `serde_json::Value`, or answers [`Unsure`]: anything it does not fully
//! understand (anchors, aliases, tags, folded or kept block scalars, scalars or flow
//! collections over several lines, tabs, carriage returns, control characters, duplicate keys,
//! numbers outside 64 bits, errors of any kind) is left to serde_yaml_ng.
//!
//! Because it accepts only constructs that end on their own line (block scalars and block
//! collections end by indentation), text it accepts cannot hide a line that would start a new
//! document or list item: that is what makes splitting a file by lines safe (see `split`).

use std::cell::Cell;

use serde_json::{Map, Value};

/// The text is outside what this reader vouches for; serde_yaml_ng must read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Unsure;

type Read<T> = Result<T, Unsure>;

/// One line: its indentation (spaces) and the rest, without the line break.
#[derive(Clone, Copy, Debug)]
struct Line<'a> {
    indent: usize,
    text: &'a str,
    /// Whether a line break ends it (false only for the last line of a text without one).
    broken: bool,
    /// Whether spaces followed `text` (content of a literal block scalar keeps them).
    spaced: bool,
}

impl Line<'_> {
    /// Blank or a comment only.
    fn is_empty(&self) -> bool {
        self.text.is_empty() || self.text.starts_with('#')
    }
}

thread_local! {
    /// The thread's line buffer between texts (empty). A file is read one object at a time,
    /// and a new buffer for each (over 1 KiB) made glibc consolidate its free lists each time.
    static SPARE: Cell<Vec<Line<'static>>> = const { Cell::new(Vec::new()) };
}

/// Buffers up to this many lines are kept for the next text.
const SPARE_LINES: usize = 4096;

/// An empty line buffer: the thread's spare one.
fn line_buffer<'a>() -> Vec<Line<'a>> {
    emptied(SPARE.take())
}

/// Keeps a line buffer (unless large) for the thread's next text.
fn recycle(lines: Vec<Line<'_>>) {
    if lines.capacity() <= SPARE_LINES {
        SPARE.set(emptied(lines));
    }
}

/// A buffer emptied, as one for lines of another lifetime: collected in place (the same
/// layout), it keeps its memory.
#[allow(clippy::unnecessary_filter_map)] // `filter` could not change the lifetime
fn emptied<'b>(mut lines: Vec<Line<'_>>) -> Vec<Line<'b>> {
    lines.clear();
    lines.into_iter().filter_map(|_| None).collect()
}

/// Splits `text` into lines, refusing characters this reader leaves to serde_yaml_ng.
fn lines(text: &str, first_indent: usize) -> Read<Vec<Line<'_>>> {
    if !text.is_ascii() && text.chars().any(refused_char) {
        return Err(Unsure);
    }
    if text.bytes().any(|b| (b < b' ' && b != b'\n') || b == 0x7f) {
        return Err(Unsure);
    }
    let mut out = line_buffer();
    out.reserve(text.len() / 24 + 1);
    let mut rest = text;
    while !rest.is_empty() {
        let (line, broken, next) = match memchr::memchr(b'\n', rest.as_bytes()) {
            Some(i) => (&rest[..i], true, &rest[i + 1..]),
            None => (rest, false, ""),
        };
        let body = line.trim_start_matches(' ');
        let mut indent = line.len() - body.len();
        if out.is_empty() {
            indent += first_indent;
        }
        // `---` or `...` at a line's start is a document marker wherever it stands; the split
        // cuts documents there, so here it can only be a text handed over whole.
        if indent == 0 && is_marker(line) {
            return Err(Unsure);
        }
        let text = body.trim_end_matches(' ');
        out.push(Line {
            indent,
            text,
            broken,
            spaced: text.len() < body.len(),
        });
        rest = next;
    }
    Ok(out)
}

fn is_marker(line: &str) -> bool {
    ["---", "..."].iter().any(|m| {
        line.strip_prefix(m)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
    })
}

/// Non-ASCII characters libyaml refuses or treats specially (C1 controls, byte order marks,
/// non-characters, line separators).
fn refused_char(c: char) -> bool {
    matches!(
        c,
        '\u{80}'..='\u{9f}' | '\u{feff}' | '\u{fffe}' | '\u{ffff}' | '\u{2028}' | '\u{2029}'
    )
}

/// Reads one document's text (after its `---` line, if any): `None` for a document with no
/// content, else its value.
pub(crate) fn document(text: &str) -> Read<Option<Value>> {
    let lines = lines(text, 0)?;
    let mut p = Parser {
        lines,
        i: 0,
        depth: 0,
    };
    let Some(first) = p.peek() else {
        return Ok(None);
    };
    let value = p.block(first.indent, first.indent)?;
    p.end()?;
    recycle(p.lines);
    Ok(Some(value))
}

/// Reads one item of a block sequence whose `-` is at column `indent`: `text` starts at that
/// `-` and holds exactly this item.
pub(crate) fn sequence_item(text: &str, indent: usize) -> Read<Value> {
    let lines = lines(text, indent)?;
    let mut p = Parser {
        lines,
        i: 0,
        depth: 0,
    };
    let mut items = p.sequence(indent)?;
    p.end()?;
    recycle(p.lines);
    match (items.pop(), items.is_empty()) {
        (Some(v), true) => Ok(v),
        _ => Err(Unsure),
    }
}

/// Reads the content of a `---` line (`--- {a: 1}`): a one-line flow collection or scalar.
pub(crate) fn marker_content(text: &str) -> Read<Value> {
    let text = text.trim_matches(' ');
    if text.starts_with(['|', '>']) || split_key(text)?.is_some() {
        return Err(Unsure);
    }
    inline(text)
}

struct Parser<'a> {
    lines: Vec<Line<'a>>,
    i: usize,
    /// Block collections open; deeper than [`MAX_DEPTH`] is left to serde_yaml_ng.
    depth: usize,
}

/// Nesting the strict reader follows (serde_yaml_ng's own limit is 128): it recurses, and must
/// not run out of stack on a hostile file.
const MAX_DEPTH: usize = 64;

impl<'a> Parser<'a> {
    /// The next line with content, skipping blank and comment lines.
    fn peek(&mut self) -> Option<Line<'a>> {
        while let Some(line) = self.lines.get(self.i) {
            if !line.is_empty() {
                return Some(*line);
            }
            self.i += 1;
        }
        None
    }

    /// Nothing but blank and comment lines may be left.
    fn end(&mut self) -> Read<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(Unsure),
        }
    }

    /// The block node whose first line is the next one, at `indent`; `parent` is the
    /// indentation of the node that holds it (for block scalars).
    fn block(&mut self, indent: usize, parent: usize) -> Read<Value> {
        let line = self.peek().ok_or(Unsure)?;
        if line.indent != indent {
            return Err(Unsure);
        }
        if is_entry(line.text) {
            return self.sequence(indent).map(Value::Array);
        }
        if split_key(line.text)?.is_some() {
            return self.mapping(indent).map(Value::Object);
        }
        // A lone scalar on its own line (`key:\n  value`): one line only.
        self.i += 1;
        let value = self.scalar_or_flow(line.text, parent)?;
        self.after_value(parent)?;
        Ok(value)
    }

    /// After a value that ended on its line, the next content line must not be indented more
    /// than `parent` (else it would continue a plain scalar, or be an error).
    fn after_value(&mut self, parent: usize) -> Read<()> {
        match self.peek() {
            Some(line) if line.indent > parent => Err(Unsure),
            _ => Ok(()),
        }
    }

    fn mapping(&mut self, indent: usize) -> Read<Map<String, Value>> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Unsure);
        }
        let mut map = Map::new();
        while let Some(line) = self.peek() {
            if line.indent < indent {
                break;
            }
            if line.indent > indent {
                return Err(Unsure);
            }
            let Some((key, rest)) = split_key(line.text)? else {
                // A sequence entry at the mapping's indentation here, or not a key: an error.
                return Err(Unsure);
            };
            self.i += 1;
            let value = self.value_after_key(rest, indent)?;
            if map.insert(key.to_string(), value).is_some() {
                return Err(Unsure);
            }
        }
        self.depth -= 1;
        Ok(map)
    }

    /// The value of a mapping entry at `indent`, whose line continues with `rest`.
    fn value_after_key(&mut self, rest: &'a str, indent: usize) -> Read<Value> {
        if rest.is_empty() || rest.starts_with('#') {
            return match self.peek() {
                Some(next) if next.indent > indent => self.block(next.indent, indent),
                // The compact form kubectl writes: `items:` then `- ` at the key's column.
                Some(next) if next.indent == indent && is_entry(next.text) => {
                    self.sequence(indent).map(Value::Array)
                }
                _ => Ok(Value::Null),
            };
        }
        let value = self.scalar_or_flow(rest, indent)?;
        self.after_value(indent)?;
        Ok(value)
    }

    fn sequence(&mut self, indent: usize) -> Read<Vec<Value>> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Unsure);
        }
        let mut items = Vec::new();
        while let Some(line) = self.peek() {
            if line.indent < indent || (line.indent == indent && !is_entry(line.text)) {
                break;
            }
            if line.indent > indent {
                return Err(Unsure);
            }
            let rest = &line.text[1..];
            let content = rest.trim_start_matches(' ');
            if content.is_empty() || content.starts_with('#') {
                self.i += 1;
                items.push(match self.peek() {
                    Some(next) if next.indent > indent => self.block(next.indent, indent)?,
                    _ => Value::Null,
                });
                continue;
            }
            let column = indent + 1 + (rest.len() - content.len());
            if is_entry(content) {
                return Err(Unsure);
            }
            if split_key(content)?.is_some() {
                // `- key: value`: a mapping whose first line starts after the `- `.
                self.lines[self.i] = Line {
                    indent: column,
                    text: content,
                    ..line
                };
                items.push(Value::Object(self.mapping(column)?));
            } else {
                self.i += 1;
                items.push(self.scalar_or_flow(content, indent)?);
                self.after_value(indent)?;
            }
        }
        self.depth -= 1;
        Ok(items)
    }

    /// A value that starts on its line after a key or `- ` (a block scalar continues on the
    /// lines below, indented more than `parent`).
    fn scalar_or_flow(&mut self, text: &'a str, parent: usize) -> Read<Value> {
        if let Some(header) = text.strip_prefix('|') {
            return self.literal(header, parent).map(Value::String);
        }
        inline(text)
    }

    /// A literal block scalar (`|` clipped or `|-` stripped) whose lines follow.
    fn literal(&mut self, header: &str, parent: usize) -> Read<String> {
        let strip = match header
            .split_once(" #")
            .map_or(header, |(h, _)| h)
            .trim_end()
        {
            "" => false,
            "-" => true,
            _ => return Err(Unsure),
        };
        let start = self.i;
        // Content indentation: that of the first non-blank line.
        let first = self.lines[start..]
            .iter()
            .find(|l| !l.text.is_empty())
            .ok_or(Unsure)?;
        let indent = first.indent;
        if indent <= parent {
            return Err(Unsure);
        }
        let mut end = start;
        while let Some(line) = self.lines.get(end) {
            if line.text.is_empty() {
                // Blank lines with spaces beyond the content indentation carry content.
                if line.indent > indent {
                    return Err(Unsure);
                }
            } else if line.indent < indent {
                break;
            } else if line.spaced {
                // Trailing spaces are content here; the lines no longer hold them.
                return Err(Unsure);
            }
            end += 1;
        }
        // Trailing blank lines are not content (both chompings drop them).
        let mut last = end;
        while last > start && self.lines[last - 1].text.is_empty() {
            last -= 1;
        }
        if !self.lines[last - 1].broken {
            return Err(Unsure);
        }
        let mut out = String::new();
        for line in &self.lines[start..last] {
            if !line.text.is_empty() {
                out.extend(std::iter::repeat_n(' ', line.indent - indent));
                out.push_str(line.text);
            }
            out.push('\n');
        }
        if strip {
            out.pop();
        }
        self.i = end;
        self.after_value(parent)?;
        Ok(out)
    }
}

/// A sequence entry: `-` followed by a space or the end of the line.
fn is_entry(text: &str) -> bool {
    text == "-" || text.starts_with("- ")
}

/// `key: rest` (or `key:`): the key and what follows the `: `, or `None` if the line is no
/// mapping entry. Keys are plain words or quoted strings without escapes.
fn split_key(text: &str) -> Read<Option<(&str, &str)>> {
    if text.starts_with(['[', '{']) {
        // A flow collection (as a key, it is left to serde_yaml_ng by `inline`).
        return Ok(None);
    }
    let (key, after) = if let Some(q) = text.strip_prefix(['"', '\'']) {
        let quote = text.as_bytes()[0] as char;
        let Some(end) = memchr::memchr(quote as u8, q.as_bytes()) else {
            return Err(Unsure);
        };
        let key = &q[..end];
        let after = &q[end + 1..];
        if !after.starts_with(':') {
            return Ok(None);
        }
        if key.contains(['\\', '"', '\'']) || !(after.len() == 1 || after[1..].starts_with(' ')) {
            return Err(Unsure);
        }
        (key, &after[1..])
    } else {
        let Some(colon) = memchr::memchr(b':', text.as_bytes()) else {
            return Ok(None);
        };
        let after = &text[colon + 1..];
        if !(after.is_empty() || after.starts_with(' ')) {
            // `http://x`: a scalar; a later `: ` would make it a key, which is left alone.
            return if has_colon_space(text) || text.ends_with(':') {
                Err(Unsure)
            } else {
                Ok(None)
            };
        }
        let key = &text[..colon];
        let plain_word = !key.is_empty()
            && key.len() < 256
            && key.as_bytes()[0].is_ascii_alphanumeric()
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'/'));
        if !plain_word {
            return Err(Unsure);
        }
        (key, after)
    };
    Ok(Some((key, after.trim_start_matches(' '))))
}

/// Whether `text` holds `: ` (`str::contains` sets up a substring search on every call; this
/// runs on most lines of a file).
fn has_colon_space(text: &str) -> bool {
    let b = text.as_bytes();
    memchr::memchr_iter(b':', b).any(|i| b.get(i + 1) == Some(&b' '))
}

/// Where the first ` #` of `text` is (the space's index).
fn comment_start(text: &str) -> Option<usize> {
    let b = text.as_bytes();
    memchr::memchr_iter(b'#', b)
        .find(|&i| i > 0 && b[i - 1] == b' ')
        .map(|i| i - 1)
}

/// A value that ends on its line: a flow collection, a quoted or a plain scalar, perhaps
/// followed by a comment.
fn inline(text: &str) -> Read<Value> {
    let mut p = Flow {
        s: text.as_bytes(),
        text,
        i: 0,
        depth: 0,
    };
    let value = if text.starts_with(['[', '{', '"', '\'']) {
        p.value()?
    } else {
        let end = comment_start(text).unwrap_or(text.len());
        p.i = end;
        plain(text[..end].trim_end_matches(' '), false)?
    };
    p.spaces();
    if p.i < p.s.len() && !text[p.i..].starts_with('#') {
        return Err(Unsure);
    }
    if p.i < p.s.len() && p.i > 0 && p.s[p.i - 1] != b' ' {
        return Err(Unsure);
    }
    Ok(value)
}

/// A plain scalar, typed as serde_yaml_ng types an untagged one (YAML 1.2 core schema):
/// null, booleans, integers and floats; anything else is a string.
fn plain(s: &str, flow: bool) -> Read<Value> {
    let Some(&first) = s.as_bytes().first() else {
        return Err(Unsure);
    };
    if matches!(
        first,
        b'-' | b'?'
            | b':'
            | b','
            | b'['
            | b']'
            | b'{'
            | b'}'
            | b'#'
            | b'&'
            | b'*'
            | b'!'
            | b'|'
            | b'>'
            | b'\''
            | b'"'
            | b'%'
            | b'@'
            | b'`'
    ) && !(first == b'-' && s.len() > 1 && s.as_bytes()[1] != b' ')
    {
        return Err(Unsure);
    }
    if has_colon_space(s)
        || s.ends_with(':')
        || (flow && memchr::memchr(b':', s.as_bytes()).is_some())
    {
        return Err(Unsure);
    }
    match s {
        "~" | "null" | "Null" | "NULL" => return Ok(Value::Null),
        "true" | "True" | "TRUE" => return Ok(Value::Bool(true)),
        "false" | "False" | "FALSE" => return Ok(Value::Bool(false)),
        _ => {}
    }
    if !matches!(first, b'0'..=b'9' | b'-' | b'.' | b'+') {
        return Ok(Value::String(s.to_string()));
    }
    let digits = s.strip_prefix('-').unwrap_or(s);
    if first == b'+' || ["0x", "0o", "0b"].iter().any(|p| digits.starts_with(p)) {
        // Signs and radix prefixes: left to serde_yaml_ng.
        return Err(Unsure);
    }
    if digits.len() > 1 && digits.starts_with('0') && digits.bytes().all(|b| b.is_ascii_digit()) {
        // Leading zeros make a string (YAML 1.2), not an octal number.
        return Ok(Value::String(s.to_string()));
    }
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return if first == b'-' {
            s.parse::<i64>().map(Value::from).map_err(|_| Unsure)
        } else {
            s.parse::<u64>().map(Value::from).map_err(|_| Unsure)
        };
    }
    match s.parse::<f64>() {
        Ok(f) if f.is_finite() => serde_json::Number::from_f64(f)
            .map(Value::Number)
            .ok_or(Unsure),
        Ok(_) => Err(Unsure),
        Err(_) if digits.starts_with('.') => Err(Unsure),
        Err(_) => Ok(Value::String(s.to_string())),
    }
}

/// A one-line flow value.
struct Flow<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
    depth: usize,
}

impl Flow<'_> {
    fn spaces(&mut self) {
        while self.s.get(self.i) == Some(&b' ') {
            self.i += 1;
        }
    }

    fn value(&mut self) -> Read<Value> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Unsure);
        }
        let value = self.value_here();
        self.depth -= 1;
        value
    }

    fn value_here(&mut self) -> Read<Value> {
        self.spaces();
        match self.s.get(self.i) {
            Some(b'[') => {
                self.i += 1;
                let mut items = Vec::new();
                self.spaces();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                loop {
                    items.push(self.value()?);
                    self.spaces();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Value::Array(items));
                        }
                        _ => return Err(Unsure),
                    }
                }
            }
            Some(b'{') => {
                self.i += 1;
                let mut map = Map::new();
                self.spaces();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Value::Object(map));
                }
                loop {
                    self.spaces();
                    let key = match self.s.get(self.i) {
                        Some(b'"') | Some(b'\'') => {
                            let Value::String(k) = self.quoted()? else {
                                return Err(Unsure);
                            };
                            if self.s.get(self.i) != Some(&b':') {
                                return Err(Unsure);
                            }
                            self.i += 1;
                            k
                        }
                        _ => {
                            let start = self.i;
                            let end = self.text[start..]
                                .find(": ")
                                .map(|e| start + e)
                                .ok_or(Unsure)?;
                            let key = &self.text[start..end];
                            if key.is_empty()
                                || !key.bytes().all(|b| {
                                    b.is_ascii_alphanumeric()
                                        || matches!(b, b'_' | b'.' | b'-' | b'/')
                                })
                                || !key.as_bytes()[0].is_ascii_alphanumeric()
                            {
                                return Err(Unsure);
                            }
                            self.i = end + 1;
                            key.to_string()
                        }
                    };
                    let value = self.value()?;
                    if map.insert(key, value).is_some() {
                        return Err(Unsure);
                    }
                    self.spaces();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Value::Object(map));
                        }
                        _ => return Err(Unsure),
                    }
                }
            }
            Some(b'"') | Some(b'\'') => self.quoted(),
            Some(_) => {
                let start = self.i;
                while let Some(&b) = self.s.get(self.i) {
                    if matches!(b, b',' | b'[' | b']' | b'{' | b'}' | b'#') {
                        break;
                    }
                    self.i += 1;
                }
                plain(self.text[start..self.i].trim_end_matches(' '), true)
            }
            None => Err(Unsure),
        }
    }

    /// A single- or double-quoted scalar that ends on this line.
    fn quoted(&mut self) -> Read<Value> {
        let quote = self.s[self.i];
        self.i += 1;
        let mut out = String::new();
        let mut start = self.i;
        loop {
            let Some(&b) = self.s.get(self.i) else {
                return Err(Unsure);
            };
            if b == quote {
                out.push_str(&self.text[start..self.i]);
                self.i += 1;
                if quote == b'\'' && self.s.get(self.i) == Some(&b'\'') {
                    out.push('\'');
                    self.i += 1;
                    start = self.i;
                    continue;
                }
                return Ok(Value::String(out));
            }
            if b == b'\\' && quote == b'"' {
                out.push_str(&self.text[start..self.i]);
                let escape = *self.s.get(self.i + 1).ok_or(Unsure)?;
                self.i += 2;
                match escape {
                    b'"' => out.push('"'),
                    b'\\' => out.push('\\'),
                    b'n' => out.push('\n'),
                    b't' => out.push('\t'),
                    b'r' => out.push('\r'),
                    b'u' => {
                        let hex = self.text.get(self.i..self.i + 4).ok_or(Unsure)?;
                        let code = u32::from_str_radix(hex, 16).map_err(|_| Unsure)?;
                        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                            return Err(Unsure);
                        }
                        out.push(char::from_u32(code).ok_or(Unsure)?);
                        self.i += 4;
                    }
                    _ => return Err(Unsure),
                }
                start = self.i;
                continue;
            }
            self.i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_buffers_are_reused() {
        let text = "a: 1\n".repeat(100);
        let lines = lines(&text, 0).unwrap();
        let (at, capacity) = (lines.as_ptr() as usize, lines.capacity());
        recycle(lines);
        let again = line_buffer();
        assert!(again.is_empty());
        assert_eq!((again.as_ptr() as usize, again.capacity()), (at, capacity));
        // A large one is not kept.
        recycle(lines_of(SPARE_LINES + 1));
        assert!(line_buffer().capacity() < SPARE_LINES);
    }

    fn lines_of(n: usize) -> Vec<Line<'static>> {
        Vec::with_capacity(n)
    }

    #[test]
    fn searches_agree_with_str_searches() {
        for text in [
            "", "#", " #", "a #b", "a#b #c", "a: b", "a:b", "a:", ":", ": ", "x:y: z", "é: #",
        ] {
            assert_eq!(comment_start(text), text.find(" #"), "{text:?}");
            assert_eq!(has_colon_space(text), text.contains(": "), "{text:?}");
        }
    }
}
