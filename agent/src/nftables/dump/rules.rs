//! Rules, decoded from kernel expressions back into the ruleset model (the inverse of
//! `encode::expr`).

use super::*;

// --- Rules. ---

/// A register as a 32-bit word index (`NFT_REG_1` = word 0, `NFT_REG32_05` = word 5): the kernel
/// dumps 16-byte register numbers where it can, whatever was sent.
/// Words stay below `u32::MAX - 8`, so that adding a register's width (at most 4 words) to one,
/// as decoding does, cannot overflow whatever a message says.
pub(super) type Word = u32;
pub(super) const VERDICT_REG: Word = u32::MAX - 8;

pub(super) fn word(r: u32) -> Word {
    match r {
        0 => VERDICT_REG,
        n @ 1..=4 => (n - 1) * 4,
        n @ 8..=23 => n - 8,
        n => n.saturating_add(1000).min(VERDICT_REG - 8),
    }
}

/// An expression reduced to what decoding needs.
#[derive(Debug)]
pub(super) enum Ex {
    Payload {
        dreg: Word,
        base: u32,
        offset: u32,
        len: u32,
    },
    Cmp {
        sreg: Word,
        op: u32,
        data: Vec<u8>,
    },
    Bitwise {
        sreg: Word,
        dreg: Word,
        len: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    MetaLoad {
        key: u32,
        dreg: Word,
    },
    MetaSet {
        key: u32,
        sreg: Word,
    },
    Lookup {
        set: String,
        sreg: Word,
        dreg: Option<Word>,
    },
    ImmValue {
        dreg: Word,
        data: Vec<u8>,
    },
    ImmVerdict(Verdict),
    Other {
        name: String,
        attrs: BTreeMap<u16, Vec<u8>>,
    },
}

pub(super) const NLA_TYPE_MASK: u16 = 0x3fff;
pub(super) const NFTA_EXPR_NAME: u16 = 1;
pub(super) const NFTA_EXPR_DATA: u16 = 2;

/// One `NFTA_LIST_ELEM` of a rule's expressions, reduced to what decoding needs.
pub(super) fn raw_expr(elem: &[u8]) -> Option<Ex> {
    let e = attr_map(elem)?;
    if !e
        .keys()
        .all(|k| [NFTA_EXPR_NAME, NFTA_EXPR_DATA].contains(k))
    {
        return None;
    }
    let name = c_string(e.get(&NFTA_EXPR_NAME)?)?;
    let a = match e.get(&NFTA_EXPR_DATA) {
        Some(d) => attr_map(d)?,
        None => Attrs::new(),
    };
    let u = |k: u16| be_u32(a.get(&k)?);
    let reg = |k: u16| u(k).map(word);
    let allowed = |ks: &[u16]| a.keys().all(|k| ks.contains(k));
    // Attribute numbers from the kernel's nf_tables.h, per expression.
    Some(match name.as_str() {
        // NFTA_PAYLOAD_DREG, _BASE, _OFFSET, _LEN (no SREG/checksum: we only load).
        "payload" if allowed(&[1, 2, 3, 4]) => Ex::Payload {
            dreg: reg(1)?,
            base: u(2)?,
            offset: u(3)?,
            len: u(4)?,
        },
        // NFTA_CMP_SREG, _OP, _DATA.
        "cmp" if allowed(&[1, 2, 3]) => Ex::Cmp {
            sreg: reg(1)?,
            op: u(2)?,
            data: data_value(a.get(&3)?)?,
        },
        // NFTA_BITWISE_SREG, _DREG, _LEN, _MASK, _XOR, _OP (NFT_BITWISE_BOOL only).
        "bitwise" if allowed(&[1, 2, 3, 4, 5, 6]) && u(6).unwrap_or(0) == 0 => Ex::Bitwise {
            sreg: reg(1)?,
            dreg: reg(2)?,
            len: u(3)?,
            mask: data_value(a.get(&4)?)?,
            xor: data_value(a.get(&5)?)?,
        },
        // NFTA_META_DREG, _KEY, _SREG.
        "meta" if allowed(&[1, 2]) => Ex::MetaLoad {
            key: u(2)?,
            dreg: reg(1)?,
        },
        "meta" if allowed(&[2, 3]) => Ex::MetaSet {
            key: u(2)?,
            sreg: reg(3)?,
        },
        // NFTA_LOOKUP_SET, _SREG, _DREG, _SET_ID, _FLAGS (no inversion).
        "lookup" if allowed(&[1, 2, 3, 4, 5]) && u(5).unwrap_or(0) == 0 => Ex::Lookup {
            set: c_string(a.get(&1)?)?,
            sreg: reg(2)?,
            dreg: if a.contains_key(&3) {
                Some(reg(3)?)
            } else {
                None
            },
        },
        // NFTA_IMMEDIATE_DREG, _DATA.
        "immediate" if allowed(&[1, 2]) => match reg(1)? {
            VERDICT_REG => Ex::ImmVerdict(data_verdict(a.get(&2)?)?),
            dreg => Ex::ImmValue {
                dreg,
                data: data_value(a.get(&2)?)?,
            },
        },
        // A payload write: NFTA_PAYLOAD_BASE, _OFFSET, _LEN, _SREG, _CSUM_TYPE, _CSUM_OFFSET,
        // _CSUM_FLAGS (decoded with the action that uses it).
        "payload" if allowed(&[2, 3, 4, 5, 6, 7, 8]) && a.contains_key(&5) => Ex::Other {
            name: "payload-write".to_string(),
            attrs: a.into_iter().map(|(k, v)| (k, v.to_vec())).collect(),
        },
        "payload" | "cmp" | "bitwise" | "meta" | "lookup" | "immediate" => return None,
        _ => Ex::Other {
            name,
            attrs: a.into_iter().map(|(k, v)| (k, v.to_vec())).collect(),
        },
    })
}

/// Attribute `k` of an untyped expression as a big-endian u32.
pub(super) fn get_u32(attrs: &BTreeMap<u16, Vec<u8>>, k: u16) -> Option<u32> {
    Some(u32::from_be_bytes(
        attrs.get(&k)?.as_slice().try_into().ok()?,
    ))
}

/// The attributes of an untyped expression are exactly `allowed` (a subset of it).
pub(super) fn only(attrs: &BTreeMap<u16, Vec<u8>>, allowed: &[u16]) -> bool {
    attrs.keys().all(|k| allowed.contains(k))
}

/// An optional u32 attribute is absent or `value`.
pub(super) fn absent_or(attrs: &BTreeMap<u16, Vec<u8>>, k: u16, value: u32) -> bool {
    !attrs.contains_key(&k) || get_u32(attrs, k) == Some(value)
}

pub(super) fn is_other<'a>(e: &'a Ex, expr: &str) -> Option<&'a BTreeMap<u16, Vec<u8>>> {
    match e {
        Ex::Other { name, attrs } if name == expr => Some(attrs),
        _ => None,
    }
}

pub(super) fn reg_of(attrs: &BTreeMap<u16, Vec<u8>>, k: u16) -> Option<Word> {
    Some(word(get_u32(attrs, k)?))
}

pub(super) const META_L4PROTO: u32 = 16;
pub(super) const META_MARK: u32 = 3;
pub(super) const META_IIFNAME: u32 = 6;
pub(super) const CMP_EQ: u32 = 0;
pub(super) const CMP_NEQ: u32 = 1;

pub(super) fn u32_ne(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.try_into().ok()?))
}

/// Prefix length of a network mask, if it is one.
pub(super) fn prefix_of(mask: &[u8]) -> Option<u8> {
    let bits: u32 = mask.iter().map(|b| b.count_ones()).sum();
    let ones = mask
        .iter()
        .flat_map(|b| (0..8).rev().map(move |i| (b >> i) & 1))
        .take_while(|&b| b == 1)
        .count() as u32;
    (bits == ones).then_some(ones as u8)
}

pub(super) fn decode_match(family: Family, ex: &[Ex]) -> Option<(Match, usize)> {
    let (saddr_off, daddr_off, alen) = addr_layout(family);
    if let Some((n, next)) = frontend_load(family, ex)
        && let Some(Ex::Lookup {
            set,
            sreg: 0,
            dreg: None,
        }) = ex.get(n)
    {
        let set = set.clone();
        let m = if next == 2 {
            Match::ProtoPortInSet { set }
        } else {
            Match::AddrProtoPortInSet { set }
        };
        return Some((m, n + 1));
    }
    if let Some((m, n)) = ct_original_match(family, ex) {
        return Some((m, n));
    }
    if let Some((m, n)) = shared_match(family, ex) {
        return Some((m, n));
    }
    match ex {
        // `ct state new` / `ct status dnat`: a conntrack key, one bit of it, compared with 0.
        [
            Ex::Other { name, attrs },
            Ex::Bitwise {
                sreg,
                dreg,
                len: 4,
                mask,
                xor,
            },
            Ex::Cmp {
                sreg: cs,
                op: CMP_NEQ,
                data,
            },
            ..,
        ] if name == "ct"
            && only(attrs, &[NFTA_CT_DREG, NFTA_CT_KEY])
            && reg_of(attrs, NFTA_CT_DREG) == Some(*sreg)
            && sreg == dreg
            && dreg == cs
            && xor == &[0; 4]
            && data == &[0; 4] =>
        {
            match (get_u32(attrs, NFTA_CT_KEY), u32_ne(mask)) {
                (Some(NFT_CT_STATE), Some(CT_STATE_NEW_BIT)) => Some((Match::CtStateNew, 3)),
                (Some(NFT_CT_STATUS), Some(CT_STATUS_DNAT_BIT)) => Some((Match::CtStatusDnat, 3)),
                _ => None,
            }
        }
        [
            Ex::Payload {
                dreg: first,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset: so,
                len: sl,
            },
            Ex::Payload {
                dreg: second,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset: d_o,
                len: dl,
            },
            Ex::Lookup {
                set,
                sreg,
                dreg: None,
            },
            ..,
        ] if *so == saddr_off
            && *d_o == daddr_off
            && *sl == alen
            && *dl == alen
            && *second == *first + alen / 4
            && sreg == first =>
        {
            Some((Match::SaddrDaddrInSet { set: set.clone() }, 3))
        }
        [
            Ex::Payload {
                dreg,
                base,
                offset,
                len,
            },
            rest @ ..,
        ] if *base == NFT_PAYLOAD_NETWORK_HEADER
            && *len == alen
            && (*offset == saddr_off || *offset == daddr_off) =>
        {
            let dest = *offset == daddr_off;
            match rest {
                [
                    Ex::Lookup {
                        set,
                        sreg,
                        dreg: None,
                    },
                    ..,
                ] if sreg == dreg => {
                    let set = set.clone();
                    let m = if dest {
                        Match::DaddrInSet { set }
                    } else {
                        Match::SaddrInSet { set }
                    };
                    Some((m, 2))
                }
                [
                    Ex::Bitwise {
                        sreg,
                        dreg: bd,
                        len: blen,
                        mask,
                        xor,
                    },
                    Ex::Cmp { sreg: cs, op, data },
                    ..,
                ] if sreg == dreg
                    && bd == dreg
                    && cs == dreg
                    && *blen == alen
                    && xor.iter().all(|&b| b == 0) =>
                {
                    let prefix = prefix_of(mask)?;
                    let net = IpNet::new(decode_addr(data)?, prefix).ok()?;
                    if net.trunc() != net {
                        return None;
                    }
                    Some((addr_match(dest, net, *op)?, 3))
                }
                [Ex::Cmp { sreg, op, data }, ..] if sreg == dreg => {
                    let addr = decode_addr(data)?;
                    let net = IpNet::new(addr, (alen * 8) as u8).ok()?;
                    Some((addr_match(dest, net, *op)?, 2))
                }
                _ => None,
            }
        }
        [
            Ex::Other { name, attrs },
            Ex::Cmp {
                sreg,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if name == "fib" => {
            if !only(attrs, &[NFTA_FIB_DREG, NFTA_FIB_RESULT, NFTA_FIB_FLAGS])
                || reg_of(attrs, NFTA_FIB_DREG) != Some(*sreg)
                || get_u32(attrs, NFTA_FIB_RESULT) != Some(NFT_FIB_RESULT_ADDRTYPE)
                || u32_ne(data) != Some(RTN_LOCAL)
            {
                return None;
            }
            match get_u32(attrs, NFTA_FIB_FLAGS)? {
                NFTA_FIB_F_SADDR => Some((Match::FibSaddrLocal, 2)),
                NFTA_FIB_F_DADDR => Some((Match::FibDaddrLocal, 2)),
                _ => None,
            }
        }
        [
            Ex::Other { name, attrs },
            Ex::Cmp {
                sreg,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if name == "numgen" => {
            let (dreg, modulus, offset) = random_numgen(attrs)?;
            if dreg != *sreg || offset != 0 {
                return None;
            }
            let value = u32_ne(data)?;
            Some((Match::Numgen { modulus, value }, 2))
        }
        [
            Ex::MetaLoad { key, dreg },
            Ex::Cmp {
                sreg,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if *key == META_L4PROTO && sreg == dreg && data.len() == 1 => {
            Some((Match::L4Proto(Proto::from_number(data[0])?), 2))
        }
        [
            Ex::MetaLoad { key, dreg },
            Ex::Bitwise {
                sreg,
                dreg: bd,
                len: 4,
                mask,
                xor,
            },
            Ex::Cmp {
                sreg: cs,
                op: CMP_EQ,
                data,
            },
            ..,
        ] if *key == META_MARK
            && sreg == dreg
            && bd == dreg
            && cs == dreg
            && xor == &[0; 4]
            && data == &[0; 4] =>
        {
            Some((
                Match::MarkUnset {
                    mask: u32_ne(mask)?,
                },
                3,
            ))
        }
        [Ex::MetaLoad { key, dreg }, Ex::Cmp { sreg, op, data }, ..]
            if *key == META_IIFNAME && sreg == dreg =>
        {
            let negate = match *op {
                CMP_EQ => false,
                CMP_NEQ => true,
                _ => return None,
            };
            let (name, prefix) = match data.iter().position(|&b| b == 0) {
                // An exact name is the NUL-padded IFNAMSIZ buffer.
                Some(end) if data.len() == 16 && data[end..].iter().all(|&b| b == 0) => {
                    (&data[..end], false)
                }
                None if !data.is_empty() => (&data[..], true),
                _ => return None,
            };
            let name = String::from_utf8(name.to_vec()).ok()?;
            Some((
                Match::IifName {
                    name,
                    prefix,
                    negate,
                },
                2,
            ))
        }
        _ => None,
    }
}

pub(super) fn addr_match(dest: bool, net: IpNet, op: u32) -> Option<Match> {
    let negate = match op {
        CMP_EQ => false,
        CMP_NEQ => true,
        _ => return None,
    };
    Some(if dest {
        Match::Daddr { net, negate }
    } else {
        Match::Saddr { net, negate }
    })
}

pub(super) fn decode_action(family: Family, ex: &[Ex]) -> Option<Action> {
    let (saddr_off, _, alen) = addr_layout(family);
    if let Some(action) = frontend_action(family, ex) {
        return Some(action);
    }
    if let Some(action) = affinity_action(family, ex) {
        return Some(action);
    }
    if let Some(action) = shared_action(family, ex) {
        return Some(action);
    }
    let reject_code = match family {
        Family::V4 => ICMP_PORT_UNREACH,
        Family::V6 => ICMPV6_PORT_UNREACH,
    };
    match ex {
        [Ex::ImmVerdict(v)] => Some(Action::Verdict(v.clone())),
        [e] if is_other(e, "reject").is_some() => {
            let attrs = is_other(e, "reject")?;
            (only(attrs, &[NFTA_REJECT_TYPE, NFTA_REJECT_ICMP_CODE])
                && get_u32(attrs, NFTA_REJECT_TYPE) == Some(NFT_REJECT_ICMP_UNREACH)
                && attrs.get(&NFTA_REJECT_ICMP_CODE).map(Vec::as_slice) == Some(&[reject_code][..]))
            .then_some(Action::Reject)
        }
        [e] if is_other(e, "masq").is_some() => {
            let attrs = is_other(e, "masq")?;
            (only(attrs, &[NFTA_MASQ_FLAGS])
                && get_u32(attrs, NFTA_MASQ_FLAGS) == Some(NF_NAT_RANGE_PROTO_RANDOM_FULLY))
            .then_some(Action::Masquerade)
        }
        [
            Ex::ImmValue {
                dreg: ra,
                data: addr,
            },
            Ex::ImmValue {
                dreg: rp,
                data: port,
            },
            e,
        ] => {
            let ok = dnat_regs(family, is_other(e, "nat")?) == Some((*ra, *rp))
                && addr.len() == alen as usize
                && port.len() == 2;
            // Not `then_some`: its argument, which indexes `port`, is evaluated either way.
            ok.then(|| {
                Some(Action::Dnat {
                    addr: decode_addr(addr)?,
                    port: u16::from_be_bytes([port[0], port[1]]),
                })
            })?
        }
        [
            Ex::Other { name, attrs: ng },
            Ex::Other {
                name: bo_name,
                attrs: bo,
            },
            Ex::Lookup {
                set,
                sreg,
                dreg: Some(data),
            },
            e,
        ] if name == "numgen" && bo_name == "byteorder" => {
            let (value, modulus, offset) = random_numgen(ng)?;
            let ok = modulus == REGION_MODULUS
                && only(
                    bo,
                    &[
                        NFTA_BYTEORDER_SREG,
                        NFTA_BYTEORDER_DREG,
                        NFTA_BYTEORDER_OP,
                        NFTA_BYTEORDER_LEN,
                        NFTA_BYTEORDER_SIZE,
                    ],
                )
                && reg_of(bo, NFTA_BYTEORDER_SREG) == Some(value)
                && reg_of(bo, NFTA_BYTEORDER_DREG) == Some(value)
                && get_u32(bo, NFTA_BYTEORDER_OP) == Some(NFT_BYTEORDER_HTON)
                && get_u32(bo, NFTA_BYTEORDER_LEN) == Some(4)
                && get_u32(bo, NFTA_BYTEORDER_SIZE) == Some(4)
                && *sreg == value
                // The endpoint's port follows its address.
                && dnat_regs(family, is_other(e, "nat")?) == Some((*data, data + alen / 4));
            ok.then_some(Action::DnatRegion {
                map: endpoint_map_name(endpoint_map_index(set)?),
                offset,
            })
        }
        [
            Ex::MetaLoad { key, dreg },
            Ex::Bitwise {
                sreg,
                dreg: bd,
                len: 4,
                mask,
                xor,
            },
            Ex::MetaSet { key: sk, sreg: ss },
        ] if *key == META_MARK && *sk == META_MARK && sreg == dreg && bd == dreg && ss == dreg => {
            let (mask, bits) = (u32_ne(mask)?, u32_ne(xor)?);
            if mask == u32::MAX {
                Some(Action::MarkXor(bits))
            } else if mask == !bits {
                Some(Action::MarkOr(bits))
            } else {
                None
            }
        }
        [
            Ex::Payload {
                dreg,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset,
                len,
            },
            e,
        ] if *offset == saddr_off && *len == alen => {
            let attrs = is_other(e, "dynset")?;
            let set = attrs.get(&NFTA_DYNSET_SET_NAME)?;
            let end = set.iter().position(|&b| b == 0).unwrap_or(set.len());
            let ok = only(
                attrs,
                &[
                    NFTA_DYNSET_SET_NAME,
                    NFTA_DYNSET_OP,
                    NFTA_DYNSET_SREG_KEY,
                    NFTA_DYNSET_TIMEOUT,
                    NFTA_DYNSET_FLAGS,
                ],
            ) && get_u32(attrs, NFTA_DYNSET_OP) == Some(NFT_DYNSET_OP_UPDATE)
                && reg_of(attrs, NFTA_DYNSET_SREG_KEY) == Some(*dreg)
                && !attrs.contains_key(&NFTA_DYNSET_SREG_DATA)
                && attrs
                    .get(&NFTA_DYNSET_TIMEOUT)
                    .is_none_or(|t| t.iter().all(|&b| b == 0))
                && absent_or(attrs, NFTA_DYNSET_FLAGS, 0);
            ok.then_some(Action::UpdateSaddr {
                set: String::from_utf8(set[..end].to_vec()).ok()?,
            })
        }
        _ => None,
    }
}

/// The actions keyed by a Service frontend: a verdict-map dispatch, or a DNAT through an
/// endpoint list.
pub(super) fn frontend_action(family: Family, ex: &[Ex]) -> Option<Action> {
    let (n, next) = frontend_load(family, ex)?;
    let nodeport = next == 2;
    match &ex[n..] {
        [
            Ex::Lookup {
                set,
                sreg: 0,
                dreg: Some(VERDICT_REG),
            },
        ] => {
            let map = set.clone();
            Some(if nodeport {
                Action::VmapProtoPort { map }
            } else {
                Action::VmapAddrProtoPort { map }
            })
        }
        [
            Ex::Other { name, attrs: ng },
            Ex::Lookup {
                set,
                sreg: 0,
                dreg: Some(data),
            },
            e,
        ] if name == "numgen" => {
            // The kernel lists the offset, 0, although none was sent.
            let (dreg, modulus, offset) = random_numgen(ng)?;
            let alen = addr_layout(family).2;
            let ok = dreg == next
                && offset == 0
                && modulus > 0
                && dnat_regs(family, is_other(e, "nat")?) == Some((*data, data + alen / 4));
            ok.then_some(Action::DnatIndexed {
                map: set.clone(),
                nodeport,
                modulus,
            })
        }
        [
            Ex::Lookup {
                set,
                sreg: 0,
                dreg: Some(data),
            },
            e,
        ] => super::rewrites::rewrite_action(family, nodeport, set, *data, e),
        _ => None,
    }
}

/// A `numgen random` expression's destination register, modulus and offset (0 if absent).
pub(super) fn random_numgen(attrs: &BTreeMap<u16, Vec<u8>>) -> Option<(Word, u32, u32)> {
    let ok = only(
        attrs,
        &[NFTA_NG_DREG, NFTA_NG_MODULUS, NFTA_NG_TYPE, NFTA_NG_OFFSET],
    ) && get_u32(attrs, NFTA_NG_TYPE) == Some(NFT_NG_RANDOM);
    let offset = match attrs.contains_key(&NFTA_NG_OFFSET) {
        true => get_u32(attrs, NFTA_NG_OFFSET)?,
        false => 0,
    };
    ok.then_some((
        reg_of(attrs, NFTA_NG_DREG)?,
        get_u32(attrs, NFTA_NG_MODULUS)?,
        offset,
    ))
}

/// `[ip daddr .] meta l4proto . th dport` loaded into consecutive words from word 0: the
/// number of expressions and the word after the last (2 without the address).
pub(super) fn frontend_load(family: Family, ex: &[Ex]) -> Option<(usize, Word)> {
    frontend_load_at(family, ex, 0)
}

/// [`frontend_load`] from word `at` on.
pub(super) fn frontend_load_at(family: Family, ex: &[Ex], at: Word) -> Option<(usize, Word)> {
    let (_, daddr_off, alen) = addr_layout(family);
    let (skip, first, word) = match ex.first()? {
        Ex::Payload {
            dreg,
            base: NFT_PAYLOAD_NETWORK_HEADER,
            offset,
            len,
        } if *offset == daddr_off && *len == alen => (1, *dreg, *dreg + alen / 4),
        _ => (0, at, at),
    };
    match ex.get(skip..skip + 2)? {
        [
            Ex::MetaLoad { key, dreg: p },
            Ex::Payload {
                dreg: d,
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                offset: 2,
                len: 2,
            },
        ] if *key == META_L4PROTO && *p == word && *d == word + 1 && first == at => {
            Some((skip + 2, word + 2))
        }
        _ => None,
    }
}

/// The address and port registers of a `nat` expression that is a `dnat` of `family` to one
/// address and port.
pub(super) fn dnat_regs(family: Family, attrs: &BTreeMap<u16, Vec<u8>>) -> Option<(Word, Word)> {
    let addr_min = reg_of(attrs, NFTA_NAT_REG_ADDR_MIN)?;
    let proto_min = reg_of(attrs, NFTA_NAT_REG_PROTO_MIN)?;
    let ok = only(
        attrs,
        &[
            NFTA_NAT_TYPE,
            NFTA_NAT_FAMILY,
            NFTA_NAT_REG_ADDR_MIN,
            NFTA_NAT_REG_ADDR_MAX,
            NFTA_NAT_REG_PROTO_MIN,
            NFTA_NAT_REG_PROTO_MAX,
            NFTA_NAT_FLAGS,
        ],
    ) && get_u32(attrs, NFTA_NAT_TYPE) == Some(NFT_NAT_DNAT)
        && get_u32(attrs, NFTA_NAT_FAMILY) == Some(u8::from(nfproto(family)).into())
        && attrs
            .get(&NFTA_NAT_REG_ADDR_MAX)
            .is_none_or(|_| reg_of(attrs, NFTA_NAT_REG_ADDR_MAX) == Some(addr_min))
        && attrs
            .get(&NFTA_NAT_REG_PROTO_MAX)
            .is_none_or(|_| reg_of(attrs, NFTA_NAT_REG_PROTO_MAX) == Some(proto_min))
        // The kernel adds NF_NAT_RANGE_MAP_IPS and PROTO_SPECIFIED itself.
        && get_u32(attrs, NFTA_NAT_FLAGS).unwrap_or(0)
            & !(NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED)
            == 0;
    ok.then_some((addr_min, proto_min))
}

/// Decodes a rule's `NFTA_RULE_EXPRESSIONS` back into the ruleset model; `None` for anything
/// nftproxy does not write.
pub(super) fn decode_rule(family: Family, exprs: &[u8], comment: Option<String>) -> Option<Rule> {
    let ex = nlas(exprs)?
        .into_iter()
        .map(|(kind, e)| {
            if kind == NFTA_LIST_ELEM {
                raw_expr(e)
            } else {
                None
            }
        })
        .collect::<Option<Vec<Ex>>>()?;
    let mut matches = Vec::new();
    let mut i = 0;
    loop {
        if let Some(action) = decode_action(family, &ex[i..]) {
            return Some(Rule {
                matches,
                action,
                comment,
            });
        }
        let (m, n) = decode_match(family, &ex[i..])?;
        matches.push(m);
        i += n;
    }
}
