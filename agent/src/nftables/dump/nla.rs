//! Raw netlink attribute walking, shared by the rule, set and element decoders.

use super::*;

// --- Raw attribute walking. ---
//
// Rules and set elements are parsed by hand rather than with the typed crate: its parsers
// format a debug dump of the whole remaining buffer as error context for every attribute they
// visit, even on success, which made reading 40,000 rules take over 10 seconds.

/// Netlink attributes of `buf` as (type without the nested/byte-order flags, payload); `None`
/// if malformed.
pub(super) fn nlas(buf: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > rest.len() {
            return None;
        }
        out.push((kind, &rest[4..len]));
        // Attributes are 4-byte aligned (NLA_ALIGN).
        rest = rest.get((len + 3) & !3..).unwrap_or(&[]);
    }
    Some(out)
}

pub(super) type Attrs<'a> = BTreeMap<u16, &'a [u8]>;

/// Attributes by type (the last one wins; used where types do not repeat).
pub(super) fn attr_map(buf: &[u8]) -> Option<Attrs<'_>> {
    Some(nlas(buf)?.into_iter().collect())
}

/// The attributes of a netlink message: after nlmsghdr (16 bytes) and nfgenmsg (4 bytes).
pub(super) fn message_nlas(msg: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    nlas(msg.get(20..)?)
}

pub(super) fn be_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.try_into().ok()?))
}

pub(super) fn c_string(b: &[u8]) -> Option<String> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8(b[..end].to_vec()).ok()
}

pub(super) const NFTA_VERDICT_CODE: u16 = 1;
pub(super) const NFTA_VERDICT_CHAIN: u16 = 2;

/// The bytes of an `NFTA_DATA_VALUE` nest.
pub(super) fn data_value(b: &[u8]) -> Option<Vec<u8>> {
    match nlas(b)?.as_slice() {
        [(NFTA_DATA_VALUE, v)] => Some(v.to_vec()),
        _ => None,
    }
}

/// The verdict of an `NFTA_DATA_VERDICT` nest.
pub(super) fn data_verdict(b: &[u8]) -> Option<Verdict> {
    let nest = nlas(b)?;
    let [(NFTA_DATA_VERDICT, v)] = nest.as_slice() else {
        return None;
    };
    let a = attr_map(v)?;
    if !a
        .keys()
        .all(|k| [NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN].contains(k))
    {
        return None;
    }
    let chain = a.get(&NFTA_VERDICT_CHAIN).and_then(|c| c_string(c));
    Some(
        match (NlVerdict::from(be_u32(a.get(&NFTA_VERDICT_CODE)?)?), chain) {
            (NlVerdict::Other(NF_ACCEPT), None) => Verdict::Accept,
            (NlVerdict::Other(NF_DROP), None) => Verdict::Drop,
            (NlVerdict::Return, None) => Verdict::Return,
            (NlVerdict::Jump, Some(c)) => Verdict::Jump(c.into()),
            (NlVerdict::Goto, Some(c)) => Verdict::Goto(c.into()),
            _ => return None,
        },
    )
}
