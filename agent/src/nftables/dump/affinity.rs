//! Rules of session affinity, decoded: lookups of a connection's original destination (`ct
//! original …`), and the DNAT to and the recording of a client's endpoint.

use super::*;

/// `ct original KEY` into a register: (key, register).
pub(super) fn ct_original_load(e: &Ex) -> Option<(u32, Word)> {
    let attrs = is_other(e, "ct")?;
    let ok = only(attrs, &[NFTA_CT_DREG, NFTA_CT_KEY, NFTA_CT_DIRECTION])
        && attrs.get(&NFTA_CT_DIRECTION).map(Vec::as_slice) == Some(&[IP_CT_DIR_ORIGINAL][..]);
    ok.then_some((get_u32(attrs, NFTA_CT_KEY)?, reg_of(attrs, NFTA_CT_DREG)?))
}

/// `ct original ip daddr . meta l4proto . ct original proto-dst` loaded from word `word` on:
/// the number of expressions.
pub(super) fn ct_original_dest_load(family: Family, ex: &[Ex], word: Word) -> Option<usize> {
    let (key, words) = match family {
        Family::V4 => (NFT_CT_DST_IP, 1),
        Family::V6 => (NFT_CT_DST_IP6, 4),
    };
    match ex.get(..3)? {
        [addr, Ex::MetaLoad { key: mk, dreg }, port]
            if ct_original_load(addr) == Some((key, word))
                && *mk == META_L4PROTO
                && *dreg == word + words
                && ct_original_load(port) == Some((NFT_CT_PROTO_DST, word + words + 1)) =>
        {
            Some(3)
        }
        _ => None,
    }
}

/// A lookup of the connection's original destination (`ct original …`) in a set.
pub(super) fn ct_original_match(family: Family, ex: &[Ex]) -> Option<(Match, usize)> {
    let member = |n: usize| match ex.get(n) {
        Some(Ex::Lookup {
            set,
            sreg: 0,
            dreg: None,
        }) => Some(set.clone()),
        _ => None,
    };
    if let Some(n) = ct_original_dest_load(family, ex, 0) {
        let set = member(n)?;
        return Some((Match::CtOriginalAddrProtoPortInSet { set }, n + 1));
    }
    match ex.get(..2)? {
        [Ex::MetaLoad { key, dreg: 0 }, port]
            if *key == META_L4PROTO && ct_original_load(port) == Some((NFT_CT_PROTO_DST, 1)) =>
        {
            let set = member(2)?;
            Some((Match::CtOriginalProtoPortInSet { set }, 3))
        }
        _ => None,
    }
}

/// The session-affinity actions: DNAT to a client's recorded endpoint, or record it.
pub(super) fn affinity_action(family: Family, ex: &[Ex]) -> Option<Action> {
    let (saddr_off, daddr_off, alen) = addr_layout(family);
    let words = alen / 4;
    let Some((
        Ex::Payload {
            dreg: 0,
            base: NFT_PAYLOAD_NETWORK_HEADER,
            offset,
            len,
        },
        rest,
    )) = ex.split_first()
    else {
        return None;
    };
    if *offset != saddr_off || *len != alen {
        return None;
    }
    use dataplane::nft::build::affinity::AFFINITY_CLIENTS;
    let static_map = |set: &str| (set == AFFINITY_CLIENTS).then_some(AFFINITY_CLIENTS);
    if let Some((n, next)) = frontend_load_at(family, rest, words) {
        return match &rest[n..] {
            [
                Ex::Lookup {
                    set,
                    sreg: 0,
                    dreg: Some(0),
                },
                e,
            ] if next == 2 * words + 2
                && dnat_regs(family, is_other(e, "nat")?) == Some((0, words)) =>
            {
                Some(Action::DnatAffinity {
                    map: static_map(set)?,
                })
            }
            _ => None,
        };
    }
    let n = ct_original_dest_load(family, rest, words)?;
    let data = 2 * words + 2;
    match &rest[n..] {
        [
            Ex::Payload {
                dreg: a,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset: ao,
                len: al,
            },
            Ex::Payload {
                dreg: p,
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                offset: 2,
                len: 2,
            },
            e,
        ] if *a == data && *ao == daddr_off && *al == alen && *p == data + words => {
            let attrs = is_other(e, "dynset")?;
            let set = c_string(attrs.get(&NFTA_DYNSET_SET_NAME)?)?;
            let timeout = attrs.get(&NFTA_DYNSET_TIMEOUT)?;
            let ms = u64::from_be_bytes(timeout.as_slice().try_into().ok()?);
            let ok = only(
                attrs,
                &[
                    NFTA_DYNSET_SET_NAME,
                    NFTA_DYNSET_OP,
                    NFTA_DYNSET_SREG_KEY,
                    NFTA_DYNSET_SREG_DATA,
                    NFTA_DYNSET_TIMEOUT,
                    NFTA_DYNSET_FLAGS,
                ],
            ) && get_u32(attrs, NFTA_DYNSET_OP) == Some(NFT_DYNSET_OP_UPDATE)
                && reg_of(attrs, NFTA_DYNSET_SREG_KEY) == Some(0)
                && reg_of(attrs, NFTA_DYNSET_SREG_DATA) == Some(data)
                && absent_or(attrs, NFTA_DYNSET_FLAGS, 0)
                && ms.is_multiple_of(1000);
            ok.then_some(Action::UpdateAffinity {
                map: static_map(&set)?,
                timeout_secs: u32::try_from(ms / 1000).ok()?,
            })
        }
        _ => None,
    }
}
