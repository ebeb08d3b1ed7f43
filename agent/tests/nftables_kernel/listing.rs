//! Normalising `nft list` and `render::table_text` for comparison, and the checks built on it.

use super::*;

// --- Normalising `nft list` and `render::table_text` for comparison. ---

pub(super) fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// nft prints durations like `3h` or `1m30s`; render prints seconds.
pub(super) fn duration_secs(text: &str) -> Option<u64> {
    let mut total = 0;
    let mut num = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num.parse().ok()?;
        num.clear();
        total += match c {
            'd' => n * 86400,
            'h' => n * 3600,
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                n / 1000
            }
            'm' => n * 60,
            's' => n,
            _ => return None,
        };
    }
    num.is_empty().then_some(total)
}

/// nft prints standard priorities by name (`dstnat`, `filter - 10`); render prints numbers.
pub(super) fn priority_value(expr: &str) -> Option<i64> {
    let parts: Vec<&str> = expr.split_whitespace().collect();
    let named = |n: &str| -> Option<i64> {
        Some(match n {
            "raw" => -300,
            "mangle" => -150,
            "dstnat" => -100,
            "filter" => 0,
            "security" => 50,
            "srcnat" => 100,
            _ => n.parse().ok()?,
        })
    };
    match parts.as_slice() {
        [n] => named(n),
        [n, "+", k] => Some(named(n)? + k.parse::<i64>().ok()?),
        [n, "-", k] => Some(named(n)? - k.parse::<i64>().ok()?),
        _ => None,
    }
}

/// The table's sets, maps and chains sorted, sets and maps first, each kind by name: nft lists
/// them in the order they were created, render by name.
pub(super) fn sort_blocks(lines: Vec<String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut blocks: Vec<((u8, String), Vec<String>)> = Vec::new();
    let mut current: Option<((u8, String), Vec<String>)> = None;
    for line in lines {
        if let Some((_, block)) = current.as_mut() {
            let done = line == "}";
            block.push(line);
            if done {
                blocks.extend(current.take());
            }
            continue;
        }
        let header = line.strip_suffix(" {").and_then(|h| {
            let (kind, name) = h.split_once(' ')?;
            let rank = match kind {
                "set" | "map" => 0,
                "chain" => 1,
                _ => return None,
            };
            Some((rank, name.to_string()))
        });
        if let Some(key) = header {
            current = Some((key, vec![line]));
            continue;
        }
        if line == "}" {
            blocks.sort();
            out.extend(blocks.drain(..).flat_map(|(_, b)| b));
        }
        out.push(line);
    }
    assert!(current.is_none(), "unterminated block");
    out.extend(blocks.into_iter().flat_map(|(_, b)| b));
    out
}

/// Lines of a table listing, whitespace-collapsed, with element lists sorted (nft prints hash
/// sets in hash order), sets, maps and chains sorted by name, priorities as numbers, timeouts in
/// seconds, and nft's `size 65535` of dynamic sets dropped. `strip_fingerprints` also drops the
/// `[fingerprint]` of chain comments.
pub(super) fn normalise(text: &str, strip_fingerprints: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    while let Some(line) = lines.next() {
        let mut line = collapse(line);
        if let Some(rest) = line.strip_prefix("elements = {") {
            let mut body = rest.to_string();
            while !body.trim_end().ends_with('}') {
                body.push(' ');
                body.push_str(lines.next().expect("unterminated element list"));
            }
            let inner = body.trim_end().strip_suffix('}').unwrap();
            let mut items: Vec<String> = inner
                .split(',')
                .map(collapse)
                .filter(|s| !s.is_empty())
                .collect();
            items.sort();
            out.push(format!("elements = {{ {} }}", items.join(", ")));
            continue;
        }
        if line == "size 65535" {
            continue;
        }
        if let Some(t) = line.strip_prefix("timeout ") {
            line = format!("timeout {}s", duration_secs(t).expect("duration"));
        }
        if let Some(start) = line.find(" priority ") {
            let rest = &line[start + " priority ".len()..];
            let end = rest.find(';').expect("priority ends with ;");
            let value = priority_value(&rest[..end]).expect("priority");
            line = format!("{} priority {value}{}", &line[..start], &rest[end..]);
        }
        if strip_fingerprints
            && line.starts_with("comment \"")
            && let Some(start) = line.rfind(" [")
            && line.ends_with("]\"")
        {
            line = format!("{}\"", &line[..start]);
        } else if strip_fingerprints && line.starts_with("comment \"[") && line.ends_with("]\"") {
            line = "comment \"\"".to_string();
        }
        out.push(line);
    }
    sort_blocks(out)
}

pub(super) fn assert_listing(ns: &Netns, table: &Table, strip_fingerprints: bool) {
    let got = normalise(&ns.list(table.family), strip_fingerprints);
    let want = normalise(&render::table_text(table), strip_fingerprints);
    if got != want {
        let diff: Vec<String> = got
            .iter()
            .zip(want.iter())
            .filter(|(g, w)| g != w)
            .take(10)
            .map(|(g, w)| format!("  nft:    {g}\n  render: {w}"))
            .collect();
        panic!(
            "nft list differs from render ({} vs {} lines):\n{}\n--- nft list ---\n{}",
            got.len(),
            want.len(),
            diff.join("\n"),
            ns.list(table.family)
        );
    }
}

/// Reads the table back and checks that planning against it changes nothing.
pub(super) fn assert_idempotent(nft: &mut Nftables, table: &Table) -> TableState {
    let state = nft
        .read_table(table.family)
        .expect("read_table")
        .expect("table exists");
    let again = plan(Some(&state), &Before::Nothing, table);
    assert!(
        again.is_empty(),
        "plan against the read-back state is not empty ({} ops):\n{}",
        again.ops.len(),
        first_lines(&render::transaction_text(&again), 30)
    );
    let cleanup = plan_cleanup(&state, table);
    assert!(
        cleanup.is_empty(),
        "cleanup plan is not empty:\n{}",
        render::transaction_text(&cleanup)
    );
    state
}

/// `state` with the fingerprints of chains that `desired` does not have cleared.
pub(super) fn without_stale_fingerprints(mut state: TableState, desired: &Table) -> TableState {
    for (name, chain) in state.chains.iter_mut() {
        if !desired.chains.contains_key(name) {
            chain.fingerprint = None;
        }
    }
    state
}

pub(super) fn first_lines(text: &str, n: usize) -> String {
    text.lines().take(n).collect::<Vec<_>>().join("\n")
}
