//! The rules of the address lists a ClusterIP's ports share, decoded: the membership of a
//! destination and protocol, and the DNAT through the shared address list and the own port.

use dataplane::nft::build::shared::{SERVICE_ENDPOINTS, SERVICE_TARGET_PORTS};

use super::*;

/// `ip daddr . meta l4proto` loaded from word 0 on: the number of expressions and the word
/// after the last.
fn addr_proto_load(family: Family, ex: &[Ex]) -> Option<(usize, Word)> {
    let (_, daddr_off, alen) = addr_layout(family);
    match ex.get(..2)? {
        [
            Ex::Payload {
                dreg: 0,
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset,
                len,
            },
            Ex::MetaLoad { key, dreg },
        ] if *offset == daddr_off && *len == alen && *key == META_L4PROTO && *dreg == alen / 4 => {
            Some((2, alen / 4 + 1))
        }
        _ => None,
    }
}

/// `ip daddr . meta l4proto @SET`.
pub(super) fn shared_match(family: Family, ex: &[Ex]) -> Option<(Match, usize)> {
    let (n, _) = addr_proto_load(family, ex)?;
    match ex.get(n)? {
        Ex::Lookup {
            set,
            sreg: 0,
            dreg: None,
        } => Some((Match::AddrProtoInSet { set: set.clone() }, n + 1)),
        _ => None,
    }
}

/// `dnat to ip daddr . meta l4proto . numgen random mod N map @ADDRESSES : ip daddr . meta
/// l4proto . th dport map @PORTS`, in nft's registers only: the address written from word 0,
/// the port key loaded and the port written from word [`SHARED_PORT_KEY_WORD`], past it.
pub(super) fn shared_action(family: Family, ex: &[Ex]) -> Option<Action> {
    const PORT: Word = SHARED_PORT_KEY_WORD;
    let (n, word) = addr_proto_load(family, ex)?;
    let [
        Ex::Other { name, attrs: ng },
        Ex::Lookup {
            set: addresses,
            sreg: 0,
            dreg: Some(0),
        },
        rest @ ..,
    ] = &ex[n..]
    else {
        return None;
    };
    if name != "numgen" {
        return None;
    }
    let (dreg, modulus, offset) = random_numgen(ng)?;
    if dreg != word || offset != 0 || modulus == 0 {
        return None;
    }
    // Three expressions: the address is loaded too.
    let (3, _) = frontend_load_at(family, rest, PORT)? else {
        return None;
    };
    let [
        Ex::Lookup {
            set: ports,
            sreg: PORT,
            dreg: Some(PORT),
        },
        e,
    ] = &rest[3..]
    else {
        return None;
    };
    // The maps these rules read have fixed names.
    let ok = addresses == SERVICE_ENDPOINTS
        && ports == SERVICE_TARGET_PORTS
        && dnat_regs(family, is_other(e, "nat")?) == Some((0, PORT));
    ok.then_some(Action::DnatShared {
        addresses: SERVICE_ENDPOINTS,
        ports: SERVICE_TARGET_PORTS,
        modulus,
    })
}
