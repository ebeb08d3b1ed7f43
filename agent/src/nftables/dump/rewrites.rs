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
    // The maps these rules read have fixed names.
    let (action, want) = match set {
        EXTERNAL_TO_CLUSTER_IPS if !nodeport => (
            Action::SetDaddr {
                map: EXTERNAL_TO_CLUSTER_IPS,
                nodeport,
            },
            PayloadWrite::daddr(family),
        ),
        NODEPORT_TO_CLUSTER_IPS if nodeport => (
            Action::SetDaddr {
                map: NODEPORT_TO_CLUSTER_IPS,
                nodeport,
            },
            PayloadWrite::daddr(family),
        ),
        NODEPORT_TO_SERVICE_PORTS if nodeport => (
            Action::SetDport {
                map: NODEPORT_TO_SERVICE_PORTS,
            },
            PayloadWrite::tcp_dport(),
        ),
        _ => return None,
    };
    (written(e)? == (data, want)).then_some(action)
}

/// The source word and the write of a payload write expression (the kernel lists absent
/// checksum attributes as 0).
fn written(e: &Ex) -> Option<(Word, PayloadWrite)> {
    let w = is_other(e, "payload-write")?;
    let or_0 = |k| get_u32(w, k).unwrap_or(0);
    Some((
        reg_of(w, NFTA_PAYLOAD_SREG)?,
        PayloadWrite {
            base: get_u32(w, NFTA_PAYLOAD_BASE)?,
            offset: get_u32(w, NFTA_PAYLOAD_OFFSET)?,
            len: get_u32(w, NFTA_PAYLOAD_LEN)?,
            csum_type: or_0(NFTA_PAYLOAD_CSUM_TYPE),
            csum_offset: or_0(NFTA_PAYLOAD_CSUM_OFFSET),
            csum_flags: or_0(NFTA_PAYLOAD_CSUM_FLAGS),
        },
    ))
}
