//! The rules that rewrite a destination before the endpoint lists (an external IP or a TCP
//! NodePort becoming its ClusterIP destination), decoded back into the ruleset model.

use super::rules::{Ex, Word, get_u32, is_other, reg_of};
use super::*;

/// The rewrite whose frontend lookup in `set` (loaded without the address for a `nodeport`)
/// writes its result from word `data` with the payload write `e`.
pub(super) fn rewrite_action(
    family: Family,
    nodeport: bool,
    set: &str,
    data: Word,
    e: &Ex,
) -> Option<Action> {
    let w = is_other(e, "payload-write")?;
    let (_, daddr_off, alen) = addr_layout(family);
    let writes = |base, offset, len, csum: (u32, u32, u32)| {
        reg_of(w, NFTA_PAYLOAD_SREG) == Some(data)
            && get_u32(w, NFTA_PAYLOAD_BASE) == Some(base)
            && get_u32(w, NFTA_PAYLOAD_OFFSET) == Some(offset)
            && get_u32(w, NFTA_PAYLOAD_LEN) == Some(len)
            && get_u32(w, NFTA_PAYLOAD_CSUM_TYPE).unwrap_or(NFT_PAYLOAD_CSUM_NONE) == csum.0
            && get_u32(w, NFTA_PAYLOAD_CSUM_OFFSET).unwrap_or(0) == csum.1
            && get_u32(w, NFTA_PAYLOAD_CSUM_FLAGS).unwrap_or(0) == csum.2
    };
    // As nft writes them: the IPv4 header checksum and, for both families, the transport
    // checksum over the pseudo-header for an address; the TCP checksum for a port.
    let daddr_csum = match family {
        Family::V4 => (NFT_PAYLOAD_CSUM_INET, 10, NFT_PAYLOAD_L4CSUM_PSEUDOHDR),
        Family::V6 => (NFT_PAYLOAD_CSUM_NONE, 0, NFT_PAYLOAD_L4CSUM_PSEUDOHDR),
    };
    let dport_csum = (NFT_PAYLOAD_CSUM_INET, TCP_CHECKSUM_OFFSET, 0);
    // The maps these rules read have fixed names.
    match set {
        EXTERNAL_TO_CLUSTER_IPS | NODEPORT_TO_CLUSTER_IPS
            if (set == NODEPORT_TO_CLUSTER_IPS) == nodeport
                && writes(NFT_PAYLOAD_NETWORK_HEADER, daddr_off, alen, daddr_csum) =>
        {
            Some(Action::SetDaddr {
                map: if nodeport {
                    NODEPORT_TO_CLUSTER_IPS
                } else {
                    EXTERNAL_TO_CLUSTER_IPS
                },
                nodeport,
            })
        }
        NODEPORT_TO_SERVICE_PORTS
            if nodeport && writes(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, dport_csum) =>
        {
            Some(Action::SetDport {
                map: NODEPORT_TO_SERVICE_PORTS,
            })
        }
        _ => None,
    }
}
