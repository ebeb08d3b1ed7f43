//! Decoding the replies of the chain, rule and set dumps into a [`TableState`].

use super::*;

/// Decodes the replies of a table's chain, rule and set dumps into its state; `dump_elements`
/// runs the element dump of one set (`None`: its result cannot be used, nor then the state's).
/// Public (hidden) for the fuzz tests, which feed it raw and mutated messages.
#[doc(hidden)]
pub fn decode_state(
    family: Family,
    chains: &[Vec<u8>],
    rules: &[Vec<u8>],
    sets: &[Vec<u8>],
    mut dump_elements: impl FnMut(&str) -> Result<Option<Vec<Vec<u8>>>, NftError>,
) -> Result<Option<TableState>, NftError> {
    // Rules per chain, in order; `None` for a rule nftproxy does not write.
    let mut chain_rules: HashMap<String, Vec<Option<Rule>>> = HashMap::new();
    for m in rules {
        let Some(attrs) = message_nlas(m) else {
            return Err(NftError::Decode {
                request: "rule dump",
                reason: "malformed rule message".to_string(),
            });
        };
        let mut table = None;
        let mut chain = None;
        let mut exprs = None;
        let mut comment = Ok(None);
        for (kind, value) in attrs {
            match kind {
                NFTA_RULE_TABLE => table = c_string(value),
                NFTA_RULE_CHAIN => chain = c_string(value),
                NFTA_RULE_EXPRESSIONS => exprs = Some(value),
                NFTA_RULE_USERDATA => comment = udata_string(value, UDATA_RULE_COMMENT),
                _ => {}
            }
        }
        if table.as_deref().is_some_and(|t| t != TABLE) {
            continue;
        }
        let Some(chain) = chain else { continue };
        let rule = match (exprs, comment) {
            (Some(e), Ok(comment)) => decode_rule(family, e, comment),
            _ => None,
        };
        if rule.is_none() {
            tracing::debug!(chain, "rule in table nftproxy not written by nftproxy");
        }
        chain_rules.entry(chain).or_default().push(rule);
    }

    let mut state = TableState::default();
    for m in parse_all("chain dump", chains)? {
        let NfTablesMessage::NewChain(c) = m else {
            continue;
        };
        if let Some((name, chain)) = decode_chain(c, &mut chain_rules) {
            state.chains.insert(name.into(), chain);
        }
    }

    let sets: Vec<Vec<u8>> = sets.iter().map(|m| opaque_set_expressions(m)).collect();
    for m in parse_all("set dump", &sets)? {
        let NfTablesMessage::NewSet(s) = m else {
            continue;
        };
        let Some(raw) = RawSet::from_message(s) else {
            continue;
        };
        let decl = raw.decl(family);
        // Collected once into a set's elements (sorted there; a key listed twice keeps its
        // last value, as inserting would).
        let mut elements = Vec::new();
        let mut decodable = decl.is_some();
        if let Some(d) = &decl
            && d.timeout_secs.is_none()
        {
            let Some(msgs) = dump_elements(&raw.name)? else {
                return Ok(None);
            };
            decodable = decode_elements(family, d, &msgs, &mut elements);
        }
        let state_entry = match decl {
            Some(decl) if decodable => SetState {
                decl,
                elements: Elements::Read(elements.into_iter().collect()),
            },
            _ => SetState {
                decl: SetDecl {
                    key: KeyType::Addr,
                    is_vmap: false,
                    comment: Some(UNDECODABLE_SET_COMMENT.to_string()),
                    timeout_secs: None,
                    size: None,
                },
                elements: Elements::Read(ElementMap::new()),
            },
        };
        state.sets.insert(raw.name, state_entry);
    }
    Ok(Some(state))
}

pub(super) const NFTA_SET_EXPR: u16 = 17;
pub(super) const NFTA_SET_EXPRESSIONS: u16 = 18;

/// A set message with its expressions (`NFTA_SET_EXPR`, `NFTA_SET_EXPRESSIONS`) retyped as
/// `NFTA_SET_UNSPEC`, which the typed crate keeps as opaque bytes: it parses expressions
/// without checking their lengths and panics on malformed ones. nftproxy writes none and
/// ignores them anyway.
pub(super) fn opaque_set_expressions(msg: &[u8]) -> Vec<u8> {
    let mut out = msg.to_vec();
    let mut at = 20; // nlmsghdr and nfgenmsg
    while at + 4 <= out.len() {
        let len = usize::from(u16::from_ne_bytes([out[at], out[at + 1]]));
        let kind = u16::from_ne_bytes([out[at + 2], out[at + 3]]) & NLA_TYPE_MASK;
        if len < 4 {
            break;
        }
        if kind == NFTA_SET_EXPR || kind == NFTA_SET_EXPRESSIONS {
            out[at + 2..at + 4].fill(0);
        }
        at += (len + 3) & !3;
    }
    out
}

/// The string of user-data TLV `kind`, if present.
pub(super) fn udata_string(udata: &[u8], kind: u8) -> Result<Option<String>, ()> {
    let mut rest = udata;
    while rest.len() >= 2 {
        let (t, len) = (rest[0], usize::from(rest[1]));
        let value = rest.get(2..2 + len).ok_or(())?;
        if t == kind {
            let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
            return String::from_utf8(value[..end].to_vec())
                .map(Some)
                .map_err(|_| ());
        }
        rest = &rest[2 + len..];
    }
    Ok(None)
}

pub(super) fn hook_of(n: u32) -> Option<Hook> {
    Some(match n {
        0 => Hook::Prerouting,
        1 => Hook::Input,
        2 => Hook::Forward,
        3 => Hook::Output,
        4 => Hook::Postrouting,
        _ => return None,
    })
}

/// A base chain nftproxy would not create: never equal to a desired one.
pub(super) const FOREIGN_BASE: BaseChain = BaseChain {
    chain_type: ChainType::Filter,
    hook: Hook::Prerouting,
    priority: i32::MIN,
};

pub(super) fn decode_chain(
    c: ChainMessage,
    rules: &mut HashMap<String, Vec<Option<Rule>>>,
) -> Option<(String, ChainState)> {
    let mut table = None;
    let mut name = None;
    let mut hook = None;
    let mut prio = None;
    let mut chain_type = None;
    let mut policy = None;
    let mut binding = false;
    for a in c.attributes {
        match a {
            ChainAttribute::Table(t) => table = Some(t),
            ChainAttribute::Name(n) => name = Some(n),
            ChainAttribute::Hook(h) => {
                for x in h {
                    match x {
                        NlHook::Number(n) => hook = Some(u32::from(n)),
                        NlHook::Priority(p) => prio = Some(p as i32),
                        _ => {}
                    }
                }
            }
            ChainAttribute::Type(t) => chain_type = Some(t),
            ChainAttribute::Policy(p) => policy = Some(p),
            ChainAttribute::Flags(f) => binding = f.contains(ChainFlags::Binding),
            _ => {}
        }
    }
    if table.as_deref() != Some(TABLE) || binding {
        return None;
    }
    let name = name?;
    let base = match hook {
        None => None,
        Some(h) => {
            let t = match chain_type.as_deref() {
                Some("filter") => Some(ChainType::Filter),
                Some("nat") => Some(ChainType::Nat),
                _ => None,
            };
            match (hook_of(h), t, prio, policy.unwrap_or(NF_ACCEPT)) {
                (Some(hook), Some(chain_type), Some(priority), NF_ACCEPT) => Some(BaseChain {
                    chain_type,
                    hook,
                    priority,
                }),
                _ => Some(FOREIGN_BASE),
            }
        }
    };
    let decoded = rules.remove(&name).unwrap_or_default();
    let empty = decoded.is_empty();
    // A rule nftproxy does not write makes the fingerprint unknown: the planner rewrites it.
    let decoded = decoded.into_iter().collect::<Option<Vec<Rule>>>();
    let region = decoded.as_deref().and_then(dnat_region);
    let fingerprint = decoded.map(|rules| {
        fingerprint(&Chain {
            base,
            comment: None,
            rules: rules.into(),
        })
    });
    Some((
        name,
        ChainState {
            base,
            fingerprint,
            empty,
            region,
        },
    ))
}
