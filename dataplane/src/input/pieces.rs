//! Where a file may be cut into pieces that are read one after the other, each as if it were
//! the whole file, so that a reader holds a few MiB of text at a time instead of all of it
//! (a 30,000-Service dump is 35–130 MB).
//!
//! Pieces end where a unit of the file does:
//! - YAML: before a `---` line. At the start of a line, `---` followed by a space or the line's
//!   end is a document start wherever it stands (YAML forbids it inside any scalar, and the
//!   reader behind serde_yaml_ng ends block scalars there), so the documents before it are
//!   complete. A `%` directive line belongs to the document after it: no cut follows one until
//!   a document has started.
//! - JSON (text starting with `{` or `[`): after a top-level value, when nothing but
//!   whitespace came between the values so far. Anything else stops the cutting, and the rest
//!   is read in one piece, as the whole file would be. So does a top-level value still open
//!   after [`LARGE_VALUE`] bytes (a `kind: List`): it is held whole anyway, and scanning the
//!   rest of it (100+ MB, before the parse can start) would only find its end.
//!
//! A single document (a `kind: List`) is one piece. Text with a byte order mark is never cut.

/// Bytes of an open top-level JSON value after which cutting stops.
const LARGE_VALUE: usize = 16 << 20;

/// How a file is cut, decided from its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cutting {
    YamlDocuments,
    JsonValues,
    Never,
}

/// Finds the cuts of a file read a block at a time. It scans each byte once: the text it is
/// given holds everything since the previous cut, of which it scans only what is new.
#[derive(Clone, Debug)]
pub struct Cutter {
    cutting: Cutting,
    /// Bytes of the text scanned so far.
    scanned: usize,
    /// The last cut found.
    last: Option<usize>,
    /// YAML: a directive line since the last document start.
    directive: bool,
    /// JSON: nesting depth, start of the open top-level value, inside a string, after a
    /// backslash in one, cutting given up.
    depth: usize,
    value_start: usize,
    in_string: bool,
    escaped: bool,
    stopped: bool,
}

impl Cutter {
    /// The cutter for a file that starts with `start` (at least its first non-blank byte,
    /// unless the file is shorter).
    pub fn new(start: &[u8]) -> Cutter {
        let cutting = if start.starts_with("\u{feff}".as_bytes()) {
            Cutting::Never
        } else {
            match start.iter().find(|b| !b" \t\r\n".contains(b)) {
                Some(b'{' | b'[') => Cutting::JsonValues,
                _ => Cutting::YamlDocuments,
            }
        };
        Cutter {
            cutting,
            scanned: 0,
            last: None,
            directive: false,
            depth: 0,
            value_start: 0,
            in_string: false,
            escaped: false,
            stopped: false,
        }
    }

    /// The largest `n > 0` such that `text[..n]` can be read as a piece of its own, `text`
    /// being everything since the previous cut (or the file's start). Call [`Cutter::cut`]
    /// when cutting there.
    pub fn last_cut(&mut self, text: &[u8]) -> Option<usize> {
        match self.cutting {
            Cutting::YamlDocuments => self.scan_yaml(text),
            Cutting::JsonValues => self.scan_json(text),
            Cutting::Never => {}
        }
        self.last
    }

    /// The text was cut at `n` (a value [`Cutter::last_cut`] returned): what follows it is
    /// the new text.
    pub fn cut(&mut self, n: usize) {
        self.scanned -= n;
        self.value_start = self.value_start.saturating_sub(n);
        self.last = None;
    }

    fn scan_yaml(&mut self, text: &[u8]) {
        let rest = &text[self.scanned..];
        let mut start = 0;
        // Only whole lines: the last one may continue in the next read.
        for end in memchr::memchr_iter(b'\n', rest) {
            let body = &rest[start..end];
            if body.first() == Some(&b'%') {
                self.directive = true;
            } else if body == b"---" || body.starts_with(b"--- ") || body.starts_with(b"---\t") {
                if self.scanned > 0 && !self.directive {
                    self.last = Some(self.scanned);
                }
                self.directive = false;
            }
            self.scanned += end + 1 - start;
            start = end + 1;
        }
    }

    /// Skips string contents with `memchr` and runs of other bytes with a table: a
    /// pretty-printed `kind: List` is one piece of 100+ MB that only this scan reads before
    /// the parse starts.
    fn scan_json(&mut self, text: &[u8]) {
        if self.depth > 0 && text.len() - self.value_start > LARGE_VALUE {
            self.stopped = true;
        }
        if self.stopped {
            return;
        }
        let mut i = self.scanned;
        while i < text.len() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                    i += 1;
                    continue;
                }
                match memchr::memchr2(b'"', b'\\', &text[i..]) {
                    Some(k) => {
                        i += k;
                        match text[i] {
                            b'"' => self.in_string = false,
                            _ => self.escaped = true,
                        }
                        i += 1;
                    }
                    None => i = text.len(),
                }
                continue;
            }
            if self.depth > 0 {
                // Inside a value, only quotes and brackets matter.
                match text[i..].iter().position(|b| STRUCTURAL[usize::from(*b)]) {
                    Some(k) => i += k,
                    None => {
                        i = text.len();
                        continue;
                    }
                }
            }
            match text[i] {
                b'"' if self.depth > 0 => self.in_string = true,
                b'{' | b'[' => {
                    if self.depth == 0 {
                        self.value_start = i;
                    }
                    self.depth += 1;
                }
                b'}' | b']' if self.depth > 0 => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        self.last = Some(i + 1);
                    }
                }
                b' ' | b'\t' | b'\r' | b'\n' => {}
                _ if self.depth > 0 => {}
                // Between top-level values, only whitespace: the rest is one piece.
                _ => {
                    self.stopped = true;
                    return;
                }
            }
            i += 1;
        }
        self.scanned = text.len();
    }
}

/// The bytes that matter to the JSON scan inside a value, outside strings.
const STRUCTURAL: [bool; 256] = {
    let mut table = [false; 256];
    table[b'"' as usize] = true;
    table[b'{' as usize] = true;
    table[b'}' as usize] = true;
    table[b'[' as usize] = true;
    table[b']' as usize] = true;
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(text: &str) -> Option<usize> {
        Cutter::new(text.as_bytes()).last_cut(text.as_bytes())
    }

    #[test]
    fn yaml_is_cut_before_the_last_complete_document_start() {
        let text = "a: 1\n---\nb: 2\n--- # c\nc: 3\n---\nd: 4";
        assert_eq!(cut(text), Some(text.find("---\nd").unwrap()));
        // A `---` line still being read is not a cut yet.
        assert_eq!(cut("a: 1\n---"), None);
        assert_eq!(cut("---\na: 1\n"), None);
        // `----` and `---x` are content.
        assert_eq!(cut("a: 1\n----\nb\n---x\n"), None);
    }

    #[test]
    fn a_directive_keeps_its_document() {
        let text = "a: 1\n...\n%YAML 1.2\n---\nb: 2\n";
        assert_eq!(cut(text), None);
        let text = "a: 1\n...\n%YAML 1.2\n---\nb: 2\n---\nc: 3\n";
        assert_eq!(cut(text), Some(text.find("---\nc").unwrap()));
    }

    #[test]
    fn json_is_cut_after_complete_top_level_values() {
        let text = r#"{"a": "}{", "b": [1, {"c": "\"}"}]} [2] {"d""#;
        assert_eq!(cut(text), Some(text.find(" {\"d\"").unwrap()));
        assert_eq!(cut(r#"{"a": 1}"#), Some(8));
        assert_eq!(cut(r#"{"a": 1"#), None);
        // Not a stream of JSON values past the first: the rest stays whole.
        let text = "{\"a\": 1}\n---\n{\"b\": 2}\n";
        assert_eq!(cut(text), Some(8));
    }

    #[test]
    fn byte_order_marks_are_never_cut() {
        assert_eq!(cut("\u{feff}a: 1\n---\nb: 2\n---\n"), None);
        assert_eq!(Cutter::new(b"  \n [1]").cutting, Cutting::JsonValues);
        assert_eq!(Cutter::new(b"kind: List\n").cutting, Cutting::YamlDocuments);
    }

    #[test]
    fn json_cutting_stops_in_a_large_value() {
        let large = format!("{{\"items\": [\"{}\"]}}\n", "x".repeat(LARGE_VALUE));
        let text = format!("[1]\n{large}[2]\n");
        let mut cutter = Cutter::new(text.as_bytes());
        let mut cuts = Vec::new();
        for end in (1 << 20..text.len()).step_by(1 << 20).chain([text.len()]) {
            cuts.extend(cutter.last_cut(&text.as_bytes()[..end]));
        }
        // After `[1]`, and never again: the rest is one piece.
        assert!(cuts.iter().all(|c| *c == 3), "{cuts:?}");
        // Whole, the value is not open after a block: it is cut after as usual.
        assert_eq!(cut(&text), Some(text.len() - 1));
    }

    #[test]
    fn json_scan_skips_strings_escapes_and_whitespace() {
        let text = "{\n    \"a\\\\\": \"\\\\\",\n    \"b\": [[1, [2]], {\"c\": \"]}\\\"\"}],\n    \"d\": \"x\"\n}\n  \t\n[ ]";
        let end = text.find("\n  \t").unwrap();
        assert_eq!(cut(text), Some(text.len()));
        assert_eq!(cut(&text[..end]), Some(end));
        // Cut inside a string or an escape: no value has ended yet.
        for at in 1..end {
            assert_eq!(cut(&text[..at]), None, "{:?}", &text[..at]);
        }
    }

    /// The JSON cut as a plain byte-at-a-time scan finds it.
    fn reference_cut(text: &[u8]) -> Option<usize> {
        let (mut depth, mut in_string, mut escaped, mut last) = (0usize, false, false, None);
        for (i, b) in text.iter().enumerate() {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' if depth > 0 => in_string = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' if depth > 0 => {
                    depth -= 1;
                    if depth == 0 {
                        last = Some(i + 1);
                    }
                }
                b' ' | b'\t' | b'\r' | b'\n' => {}
                _ if depth > 0 => {}
                _ => return last,
            }
        }
        last
    }

    proptest::proptest! {
        /// Any text of JSON's structural bytes, fed in blocks of any size, is cut where the
        /// byte-at-a-time scan cuts it.
        #[test]
        fn json_cuts_match_a_byte_at_a_time_scan(
            bytes in proptest::collection::vec(
                proptest::sample::select(b"{}[]\"\\ \n\ta,:".to_vec()), 0..200),
            block in 1usize..40,
        ) {
            let mut text = vec![b'{'];
            text.extend(bytes);
            let mut cutter = Cutter::new(&text);
            let mut found = None;
            for end in (block..text.len()).step_by(block).chain([text.len()]) {
                found = cutter.last_cut(&text[..end]).or(found);
            }
            proptest::prop_assert_eq!(found, reference_cut(&text));
        }
    }

    /// Fed a block at a time and cut wherever it can be, a text comes out in the same pieces
    /// whatever the blocks, and each piece ends where a unit does.
    #[test]
    fn blocks_of_any_size_give_the_same_pieces() {
        let yaml = "a: 1\n---\nb: \"x\"\n...\n%YAML 1.2\n---\nc: 3\n--- |\n  d\n---\ne: 5\n";
        let json = "{\"a\": \"}\\\"\"}\n[1, [2]]\n\n{\"b\": {}}  {\"c\": 3}\n";
        for text in [yaml, json] {
            let pieces = |block: usize| {
                let mut cutter = Cutter::new(text.as_bytes());
                let (mut pieces, mut buf) = (Vec::new(), Vec::new());
                for chunk in text.as_bytes().chunks(block) {
                    buf.extend_from_slice(chunk);
                    if let Some(n) = cutter.last_cut(&buf) {
                        pieces.push(String::from_utf8(buf.drain(..n).collect()).unwrap());
                        cutter.cut(n);
                    }
                }
                pieces.push(String::from_utf8(buf).unwrap());
                pieces
            };
            let whole = pieces(text.len());
            assert_eq!(whole.concat(), text);
            for block in 1..text.len() {
                let p = pieces(block);
                assert_eq!(p.concat(), text, "block {block}");
                // Smaller blocks may cut more often, never elsewhere.
                let mut at = 0;
                let ends: Vec<usize> = p
                    .iter()
                    .map(|s| {
                        at += s.len();
                        at
                    })
                    .collect();
                let mut at = 0;
                let whole_cuts: Vec<usize> = pieces(1)
                    .iter()
                    .map(|s| {
                        at += s.len();
                        at
                    })
                    .collect();
                assert!(
                    ends.iter().all(|e| whole_cuts.contains(e)),
                    "block {block}: {p:?}"
                );
            }
        }
    }
}
