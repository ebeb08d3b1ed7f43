//! Faults that end-to-end tests inject into the real binary, through environment variables
//! only tests set. Each is read once; unset (always, outside tests) they do nothing.
//!
//! - `NFTPROXY_TEST_REFUSE=TEXT`: nftables operations whose nft text contains `TEXT` are
//!   refused as the kernel refuses an invalid operation (for an element operation, only the
//!   matching element is named), as if one Service's rules could not be programmed.
//! - `NFTPROXY_TEST_FAIL_FAMILY=IPv4|IPv6`: every sync of that family fails.
//! - `NFTPROXY_TEST_PANIC=sync`: the sync thread panics before its first sync.

use std::sync::OnceLock;

use dataplane::nft::render;
use dataplane::nft::ruleset::Family;
use dataplane::nft::transaction::{Op, Transaction};

fn var(name: &'static str, cell: &'static OnceLock<Option<String>>) -> Option<&'static str> {
    cell.get_or_init(|| std::env::var(name).ok().filter(|v| !v.is_empty()))
        .as_deref()
}

fn refuse_text() -> Option<&'static str> {
    static CELL: OnceLock<Option<String>> = OnceLock::new();
    var("NFTPROXY_TEST_REFUSE", &CELL)
}

/// `NFTPROXY_TEST_REFUSE`: the first operation of `tx` (index, and the refused part) whose
/// text contains the configured text.
pub fn refused_op(tx: &Transaction) -> Option<(usize, Op)> {
    let text = refuse_text()?;
    let matches = |op: &Op| {
        let one = Transaction {
            family: tx.family,
            ops: vec![op.clone()],
        };
        render::transaction_text(&one).contains(text)
    };
    tx.ops.iter().enumerate().find_map(|(index, op)| match op {
        Op::AddElements { set, elements } => elements.iter().find_map(|e| {
            let part = Op::AddElements {
                set: set.clone(),
                elements: vec![e.clone()].into(),
            };
            matches(&part).then_some((index, part))
        }),
        Op::AddRules { .. } | Op::AddChain { .. } => matches(op).then(|| (index, op.clone())),
        _ => None,
    })
}

/// `NFTPROXY_TEST_FAIL_FAMILY`: whether syncs of `family` are to fail.
pub fn fail_family(family: Family) -> bool {
    static CELL: OnceLock<Option<String>> = OnceLock::new();
    var("NFTPROXY_TEST_FAIL_FAMILY", &CELL) == Some(family.k8s_name())
}

/// `NFTPROXY_TEST_PANIC`: whether `place` is to panic.
pub fn panic_in(place: &str) -> bool {
    static CELL: OnceLock<Option<String>> = OnceLock::new();
    var("NFTPROXY_TEST_PANIC", &CELL) == Some(place)
}
