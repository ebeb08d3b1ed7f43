//! Planner operations to nf_tables netlink messages.
//!
//! Everything the typed `netlink-packet-netfilter` crate models (tables, chains, rules, sets,
//! elements and the `payload`/`cmp`/`bitwise`/`meta`/`lookup`/`immediate` expressions) is built
//! with its types. The expressions it does not model (`ct`, `fib`, `numgen`, `byteorder`,
//! `reject`, `nat`, `masq`, `dynset`) go through its `Expressions::Other` escape hatch: their
//! attributes are flat lists of big-endian `u32`s or strings, built by [`u32_attr`] /
//! [`str_attr`].
//!
//! The encodings are the ones `nft` 1.0.6 produces (checked with `nft --debug=netlink`), so that
//! `nft list` prints every rule exactly as `dataplane::nft::render::rule_text_in` renders it.

use std::net::IpAddr;

use dataplane::nft::ruleset::{
    Action, BaseChain, ChainType, Family, Hook, Key, KeyType, Match, REGION_MODULUS, Rule, SetDecl,
    TABLE, TABLE_COMMENT, Value, Verdict,
};
use dataplane::nft::transaction::{Op, Transaction};
use ipnet::IpNet;
use netlink_packet_core::{
    DefaultNla, NLA_F_NESTED, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST, NetlinkMessage,
    Nla,
};
use netlink_packet_netfilter::nftables::{
    Bitwise, ChainAttribute, ChainMessage, Cmp, DataAttribute, ExpressionAttribute, Expressions,
    Hook as NlHook, HookNumber, Immediate, InetHookNumber, ListAttribute, Lookup, Meta, MetaKey,
    NfTablesMessage, Operator, Payload, Register, RuleAttribute, RuleMessage, SetAttribute,
    SetDescription, SetElementList, SetElementMessage, SetFlags, SetMessage, TableAttribute,
    TableFlags, TableMessage, Verdict as NlVerdict, VerdictAttribute,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};

mod expr;
mod layout;
#[cfg(test)]
mod tests;

pub(super) use self::expr::*;
pub(super) use self::layout::*;

// --- Constants from the kernel's uapi headers that the typed crate does not export. ---

/// `NFNL_SUBSYS_NFTABLES`: the batch messages carry it as their resource id.
const NFNL_SUBSYS_NFTABLES: u16 = 10;

pub(super) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(super) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;

/// `NF_DROP` / `NF_ACCEPT`: verdict codes the typed `Verdict` only knows as `Other`.
pub(super) const NF_DROP: u32 = 0;
pub(super) const NF_ACCEPT: u32 = 1;

pub(super) const NFTA_CT_DREG: u16 = 1;
pub(super) const NFTA_CT_KEY: u16 = 2;
pub(super) const NFT_CT_STATE: u32 = 0;
/// `IP_CT_NEW` as a `ct state` bit (`NF_CT_STATE_BIT(IP_CT_NEW)`).
pub(super) const CT_STATE_NEW_BIT: u32 = 1 << 3;
pub(super) const NFT_CT_STATUS: u32 = 2;
pub(super) const NFTA_CT_DIRECTION: u16 = 3;
pub(super) const IP_CT_DIR_ORIGINAL: u8 = 0;
pub(super) const NFT_CT_PROTO_DST: u32 = 12;
pub(super) const NFT_CT_DST_IP: u32 = 20;
pub(super) const NFT_CT_DST_IP6: u32 = 22;
/// `IPS_DST_NAT` as a `ct status` bit.
pub(super) const CT_STATUS_DNAT_BIT: u32 = 1 << 5;

pub(super) const NFTA_FIB_DREG: u16 = 1;
pub(super) const NFTA_FIB_RESULT: u16 = 2;
pub(super) const NFTA_FIB_FLAGS: u16 = 3;
pub(super) const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
pub(super) const NFTA_FIB_F_SADDR: u32 = 1;
pub(super) const NFTA_FIB_F_DADDR: u32 = 2;
/// `RTN_LOCAL`, compared host-endian against the fib result.
pub(super) const RTN_LOCAL: u32 = 2;

pub(super) const NFTA_NG_DREG: u16 = 1;
pub(super) const NFTA_NG_MODULUS: u16 = 2;
pub(super) const NFTA_NG_TYPE: u16 = 3;
pub(super) const NFTA_NG_OFFSET: u16 = 4;
pub(super) const NFT_NG_RANDOM: u32 = 1;

pub(super) const NFTA_BYTEORDER_SREG: u16 = 1;
pub(super) const NFTA_BYTEORDER_DREG: u16 = 2;
pub(super) const NFTA_BYTEORDER_OP: u16 = 3;
pub(super) const NFTA_BYTEORDER_LEN: u16 = 4;
pub(super) const NFTA_BYTEORDER_SIZE: u16 = 5;
pub(super) const NFT_BYTEORDER_HTON: u32 = 1;

pub(super) const NFTA_REJECT_TYPE: u16 = 1;
pub(super) const NFTA_REJECT_ICMP_CODE: u16 = 2;
pub(super) const NFT_REJECT_ICMP_UNREACH: u32 = 0;
pub(super) const ICMP_PORT_UNREACH: u8 = 3;
pub(super) const ICMPV6_PORT_UNREACH: u8 = 4;

pub(super) const NFTA_NAT_TYPE: u16 = 1;
pub(super) const NFTA_NAT_FAMILY: u16 = 2;
pub(super) const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
pub(super) const NFTA_NAT_REG_ADDR_MAX: u16 = 4;
pub(super) const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
pub(super) const NFTA_NAT_REG_PROTO_MAX: u16 = 6;
pub(super) const NFTA_NAT_FLAGS: u16 = 7;
pub(super) const NFT_NAT_DNAT: u32 = 1;
pub(super) const NF_NAT_RANGE_MAP_IPS: u32 = 0x1;
pub(super) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;

pub(super) const NFTA_MASQ_FLAGS: u16 = 1;
pub(super) const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;

pub(super) const NFTA_DYNSET_SET_NAME: u16 = 1;
pub(super) const NFTA_DYNSET_OP: u16 = 3;
pub(super) const NFTA_DYNSET_SREG_KEY: u16 = 4;
pub(super) const NFTA_DYNSET_SREG_DATA: u16 = 5;
pub(super) const NFTA_DYNSET_TIMEOUT: u16 = 6;
pub(super) const NFTA_DYNSET_FLAGS: u16 = 9;
pub(super) const NFT_DYNSET_OP_UPDATE: u32 = 1;

/// `NFT_DATA_VERDICT`: the data type of a verdict map.
pub(super) const NFT_DATA_VERDICT: u32 = 0xffff_ff00;

/// nft's data type ids (`NFTA_SET_KEY_TYPE`; only `nft` reads them, to print keys).
pub(super) const TYPE_INTEGER: u32 = 4;
pub(super) const TYPE_IPV4_ADDR: u32 = 7;
pub(super) const TYPE_IPV6_ADDR: u32 = 8;
pub(super) const TYPE_INET_PROTO: u32 = 12;
pub(super) const TYPE_INET_SERVICE: u32 = 13;
/// nft composes the type id of a concatenation 6 bits per field.
const CONCAT_TYPE_BITS: u32 = 6;

/// libnftnl user-data TLV types (`[type, len, value...]`, strings NUL-terminated).
pub(super) const UDATA_TABLE_COMMENT: u8 = 0;
pub(super) const UDATA_CHAIN_COMMENT: u8 = 0;
pub(super) const UDATA_RULE_COMMENT: u8 = 0;
pub(super) const UDATA_SET_KEYBYTEORDER: u8 = 0;
const UDATA_SET_DATABYTEORDER: u8 = 1;
const UDATA_SET_KEY_TYPEOF: u8 = 3;
const UDATA_SET_DATA_TYPEOF: u8 = 4;
const UDATA_SET_DATA_INTERVAL: u8 = 6;
pub(super) const UDATA_SET_COMMENT: u8 = 7;
/// Inside a `typeof` TLV: nft's expression kind, then its own TLVs.
const UDATA_TYPEOF_EXPR: u8 = 0;
const UDATA_TYPEOF_DATA: u8 = 1;
/// nft's expression kinds (`enum expr_types`) of the `typeof` of an endpoint map.
const EXPR_PAYLOAD: u32 = 7;
const EXPR_META: u32 = 9;
const EXPR_CONCAT: u32 = 13;
const EXPR_NUMGEN: u32 = 23;
/// nft's protocol descriptions (`enum proto_desc_id`) and header field indexes.
const PROTO_DESC_TH: u32 = 11;
const PROTO_DESC_IP: u32 = 12;
const PROTO_DESC_IP6: u32 = 13;
const IPHDR_SADDR: u32 = 11;
const IPHDR_DADDR: u32 = 12;
const IP6HDR_SADDR: u32 = 8;
const IP6HDR_DADDR: u32 = 9;
const THDR_DPORT: u32 = 2;
/// nft's byte orders (`enum byteorder`): the byte order of address sets, and those nft records
/// for an endpoint map (a host-endian `numgen` key, concatenated data of no single order).
const BYTEORDER_INVALID: u32 = 0;
const BYTEORDER_HOST_ENDIAN: u32 = 1;
const BYTEORDER_BIG_ENDIAN: u32 = 2;
/// The kernel's `NFT_USERDATA_MAXLEN`.
const USERDATA_MAXLEN: usize = 256;

/// Netlink attribute lengths are 16 bits: a message never exceeds this, so no attribute inside it
/// can overflow. The element chunker aims well below it.
pub(super) const MAX_MESSAGE_BYTES: usize = 65_535;
const ELEMENT_LIST_TARGET_BYTES: usize = 60_000;

/// One nf_tables message and the netlink flags it is sent with (besides `NLM_F_REQUEST`).
pub(super) struct Command {
    pub msg: NfTablesMessage,
    pub flags: u16,
}

fn table_message() -> Result<Command, String> {
    Ok(Command {
        msg: NfTablesMessage::NewTable(TableMessage {
            attributes: vec![
                TableAttribute::Name(TABLE.to_string()),
                TableAttribute::Flags(TableFlags::empty()),
                TableAttribute::UserData(udata_string(UDATA_TABLE_COMMENT, TABLE_COMMENT)?),
            ],
        }),
        // No NLM_F_EXCL: adding an existing table is a no-op.
        flags: NLM_F_CREATE,
    })
}

fn chain_message(
    name: &str,
    base: &Option<BaseChain>,
    comment: Option<&str>,
) -> Result<Command, String> {
    let mut attributes = vec![
        ChainAttribute::Table(TABLE.to_string()),
        ChainAttribute::Name(name.to_string()),
    ];
    if let Some(b) = base {
        attributes.push(ChainAttribute::Hook(vec![
            NlHook::Number(HookNumber::Inet(hook_number(b.hook))),
            // The kernel reads the priority as a big-endian s32.
            NlHook::Priority(b.priority as u32),
        ]));
        attributes.push(ChainAttribute::Policy(NF_ACCEPT));
        attributes.push(ChainAttribute::Type(
            chain_type_name(b.chain_type).to_string(),
        ));
    }
    if let Some(comment) = comment {
        attributes.push(ChainAttribute::UserData(udata_string(
            UDATA_CHAIN_COMMENT,
            comment,
        )?));
    }
    Ok(Command {
        msg: NfTablesMessage::NewChain(ChainMessage { attributes }),
        // No NLM_F_EXCL: re-adding an existing chain is not an error.
        flags: NLM_F_CREATE,
    })
}

fn set_message(family: Family, name: &str, decl: &SetDecl, id: u32) -> Result<Command, String> {
    // Maps to endpoints are what nft 1.0.6 creates for their `typeof` (an endpoint map also has
    // `flags interval`): maps to `ADDR . inet_service`.
    let endpoint_map = decl.key.holds_endpoints();
    let dynamic_ok = decl.key == KeyType::AffinityClients;
    if endpoint_map && (decl.is_vmap || (decl.timeout_secs.is_some() && !dynamic_ok)) {
        return Err(format!(
            "endpoint map {name} cannot be a verdict map or have a timeout"
        ));
    }
    let value_map = value_data_layout(family, decl.key);
    if value_map.is_some() && (decl.is_vmap || decl.timeout_secs.is_some()) {
        return Err(format!(
            "address or port map {name} cannot be a verdict map or have a timeout"
        ));
    }
    let (key_type, key_len) = key_layout(family, decl.key);
    let mut flags = SetFlags::empty();
    if decl.is_vmap || endpoint_map || value_map.is_some() {
        flags |= SetFlags::Map;
    }
    if decl.key == KeyType::Interval {
        flags |= SetFlags::Interval;
    }
    if decl.timeout_secs.is_some() {
        flags |= SetFlags::Timeout | SetFlags::Eval;
    }
    let mut attributes = vec![
        SetAttribute::Table(TABLE.to_string()),
        SetAttribute::Name(name.to_string()),
        SetAttribute::Flags(flags),
        SetAttribute::KeyType(key_type),
        SetAttribute::KeyLen(key_len),
    ];
    if decl.is_vmap {
        // Verdict data needs no NFTA_SET_DATA_LEN: the kernel knows a verdict's size.
        attributes.push(SetAttribute::DataType(NFT_DATA_VERDICT));
    }
    if let Some((data_type, data_len)) = value_map {
        attributes.push(SetAttribute::DataType(data_type));
        attributes.push(SetAttribute::DataLen(data_len));
    }
    if endpoint_map {
        let (data_type, data_len) = endpoint_data_layout(family);
        attributes.push(SetAttribute::DataType(data_type));
        attributes.push(SetAttribute::DataLen(data_len));
    }
    if let Some(size) = decl.size {
        attributes.push(SetAttribute::Description(vec![SetDescription::Size(size)]));
    }
    attributes.push(SetAttribute::Id(id));
    if let Some(secs) = decl.timeout_secs {
        attributes.push(SetAttribute::Timeout(u64::from(secs) * 1000));
    }
    let mut udata = set_udata(family, decl);
    if let Some(c) = &decl.comment {
        udata.extend(udata_string(UDATA_SET_COMMENT, c)?);
    }
    if udata.len() > USERDATA_MAXLEN {
        return Err("set user data exceeds 256 bytes".to_string());
    }
    if !udata.is_empty() {
        attributes.push(SetAttribute::UserData(udata));
    }
    Ok(Command {
        msg: NfTablesMessage::NewSet(SetMessage { attributes }),
        flags: NLM_F_CREATE,
    })
}

/// Element messages for `set`: `elements` (serialised by [`put_elements`]) in lists that stay
/// well below the 64 KiB attribute limit whatever the planner's chunk size.
fn element_messages(
    family: Family,
    set: &str,
    elements: impl Iterator<Item = (Key, Option<Value>)>,
    delete: bool,
) -> Result<Vec<Command>, String> {
    let (make, flags): (fn(SetElementMessage) -> NfTablesMessage, u16) = if delete {
        (NfTablesMessage::DeleteSetElement, 0)
    } else {
        (NfTablesMessage::NewSetElement, NLM_F_CREATE)
    };
    let mut out = Vec::new();
    let flush = |list: Vec<u8>, out: &mut Vec<Command>| {
        out.push(Command {
            msg: make(element_list(set, list)),
            flags,
        });
    };
    let mut list = Vec::with_capacity(ELEMENT_LIST_TARGET_BYTES + 512);
    for (key, value) in elements {
        let before = list.len();
        put_elements(family, &key, value.as_ref(), delete, &mut list)?;
        if before > 0 && list.len() > ELEMENT_LIST_TARGET_BYTES {
            let rest = list.split_off(before);
            flush(std::mem::replace(&mut list, rest), &mut out);
        }
    }
    if !list.is_empty() {
        flush(list, &mut out);
    }
    Ok(out)
}

/// The elements `list` (serialised `NFTA_LIST_ELEM` attributes) of `set` in our table.
fn element_list(set: &str, list: Vec<u8>) -> SetElementMessage {
    SetElementMessage {
        attributes: vec![
            SetElementList::Table(TABLE.to_string()),
            SetElementList::Set(set.to_string()),
            SetElementList::Other(DefaultNla::new(
                NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED,
                list,
            )),
        ],
    }
}

pub(super) const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub(super) const NFTA_LIST_ELEM: u16 = 1;
pub(super) const NFTA_SET_ELEM_KEY: u16 = 1;
pub(super) const NFTA_SET_ELEM_DATA: u16 = 2;
pub(super) const NFTA_SET_ELEM_FLAGS: u16 = 3;
pub(super) const NFTA_DATA_VALUE: u16 = 1;
pub(super) const NFTA_DATA_VERDICT: u16 = 2;
pub(super) const NFT_SET_ELEM_INTERVAL_END: u32 = 1;

/// Appends attribute `kind` holding `value`, padded to 4 bytes.
fn put_attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len() + (4 - len % 4) % 4, 0);
}

/// Runs `fill` to append the attributes nested in attribute `kind`.
fn put_nested(out: &mut Vec<u8>, kind: u16, fill: impl FnOnce(&mut Vec<u8>)) {
    let at = out.len();
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    fill(out);
    let len = (out.len() - at) as u16;
    out[at..at + 2].copy_from_slice(&len.to_ne_bytes());
}

/// Verdicts are rare (verdict-map elements), so the crate writes their attributes.
fn put_verdict(out: &mut Vec<u8>, v: &Verdict) {
    put_nested(out, NFTA_DATA_VERDICT, |out| {
        for attr in verdict_attrs(v) {
            let mut value = vec![0; attr.value_len()];
            attr.emit_value(&mut value);
            put_attr(out, attr.kind(), &value);
        }
    });
}

/// Appends the kernel elements of one planner element (`NFTA_LIST_ELEM` attributes), written
/// directly: building the crate's attribute tree for 400k elements, then measuring and
/// emitting it, was most of a cold sync's encoding time. An endpoint-map interval is two
/// elements: its start (with the endpoint as data) and its end (flagged as an interval end).
/// `delete` leaves out data: the kernel finds an element by key and, for an end, the flag.
fn put_elements(
    family: Family,
    key: &Key,
    value: Option<&Value>,
    delete: bool,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let data = match (value, delete) {
        (_, true) | (None, false) => None,
        (Some(Value::Endpoint(addr, port)), false) if key.key_type().holds_endpoints() => {
            Some(Ok(endpoint_data(family, addr, *port)?))
        }
        (Some(Value::Endpoint(..)), false) => {
            return Err("an endpoint as the value of a map other than an endpoint map".to_string());
        }
        (Some(Value::Addr(addr)), false)
            if matches!(
                key,
                Key::AddrProtoPort(..) | Key::ProtoPort(..) | Key::AddrProtoIndex(..)
            ) =>
        {
            Some(Ok(addr_data(family, addr)?))
        }
        (Some(Value::Port(port)), false)
            if matches!(key, Key::ProtoPort(..) | Key::AddrProtoPort(..)) =>
        {
            Some(Ok(port_data(*port)))
        }
        (Some(Value::Addr(_) | Value::Port(_)), false) => {
            return Err("an address or port as the value of a map of other keys".to_string());
        }
        (Some(Value::Verdict(v)), false) => Some(Err(v)),
    };
    if matches!(key, Key::Interval { .. }) && data.is_none() && !delete {
        return Err("an endpoint-map interval without its endpoint".to_string());
    }
    let key_value = key_bytes(family, key)?;
    put_nested(out, NFTA_LIST_ELEM, |out| {
        put_nested(out, NFTA_SET_ELEM_KEY, |out| {
            put_attr(out, NFTA_DATA_VALUE, &key_value)
        });
        match &data {
            Some(Ok(bytes)) => put_nested(out, NFTA_SET_ELEM_DATA, |out| {
                put_attr(out, NFTA_DATA_VALUE, bytes)
            }),
            Some(Err(v)) => put_nested(out, NFTA_SET_ELEM_DATA, |out| put_verdict(out, v)),
            None => {}
        }
    });
    // The interval's end: its own element, flagged.
    if let Key::Interval { end, .. } = key {
        put_nested(out, NFTA_LIST_ELEM, |out| {
            put_nested(out, NFTA_SET_ELEM_KEY, |out| {
                put_attr(out, NFTA_DATA_VALUE, &end.to_be_bytes())
            });
            put_attr(
                out,
                NFTA_SET_ELEM_FLAGS,
                &NFT_SET_ELEM_INTERVAL_END.to_be_bytes(),
            );
        });
    }
    Ok(())
}

/// `attr` serialised once, as an opaque attribute (`other` wraps it). Emitting a message
/// computes each nested attribute's length again at every level above it, so a rule's
/// expressions and an element list (the deepest and largest parts) were measured again and
/// again: about half the encoding time of a cold sync.
fn pre_emitted<T: Nla>(attr: T, other: fn(DefaultNla) -> T) -> T {
    let mut value = vec![0; attr.value_len()];
    attr.emit_value(&mut value);
    other(DefaultNla::new(attr.kind(), value))
}

fn rule_message(family: Family, chain: &str, rule: &Rule) -> Result<Command, String> {
    let mut attributes = vec![
        RuleAttribute::Table(TABLE.to_string()),
        RuleAttribute::Chain(chain.to_string()),
        pre_emitted(
            RuleAttribute::Expressions(rule_exprs(family, rule)?),
            RuleAttribute::Other,
        ),
    ];
    if let Some(c) = &rule.comment {
        attributes.push(RuleAttribute::UserData(udata_string(
            UDATA_RULE_COMMENT,
            c,
        )?));
    }
    Ok(Command {
        msg: NfTablesMessage::NewRule(RuleMessage { attributes }),
        flags: NLM_F_CREATE | NLM_F_APPEND,
    })
}

/// The messages of one operation. `next_set_id` numbers the sets created in the batch.
pub(super) fn encode_op(
    family: Family,
    op: &Op,
    next_set_id: &mut u32,
) -> Result<Vec<Command>, String> {
    let table_only = || TABLE.to_string();
    Ok(match op {
        Op::AddTable => vec![table_message()?],
        Op::DeleteTable => vec![Command {
            msg: NfTablesMessage::DeleteTable(TableMessage {
                attributes: vec![TableAttribute::Name(table_only())],
            }),
            flags: 0,
        }],
        Op::AddChain {
            name,
            base,
            comment,
            ..
        } => vec![chain_message(name, base, comment.as_deref())?],
        Op::FlushChain { name } => vec![Command {
            // DELRULE with a chain and no handle deletes all rules of the chain.
            msg: NfTablesMessage::DeleteRule(RuleMessage {
                attributes: vec![
                    RuleAttribute::Table(table_only()),
                    RuleAttribute::Chain(name.to_string()),
                ],
            }),
            flags: 0,
        }],
        Op::DeleteChain { name } => vec![Command {
            msg: NfTablesMessage::DeleteChain(ChainMessage {
                attributes: vec![
                    ChainAttribute::Table(table_only()),
                    ChainAttribute::Name(name.to_string()),
                ],
            }),
            flags: 0,
        }],
        Op::AddRules { chain, rules } => rules
            .iter()
            .map(|rule| rule_message(family, chain, rule))
            .collect::<Result<_, _>>()?,
        Op::AddSet { name, decl } => {
            *next_set_id += 1;
            vec![set_message(family, name, decl, *next_set_id)?]
        }
        Op::DeleteSet { name } => vec![Command {
            msg: NfTablesMessage::DeleteSet(SetMessage {
                attributes: vec![
                    SetAttribute::Table(table_only()),
                    SetAttribute::Name(name.clone()),
                ],
            }),
            flags: 0,
        }],
        Op::AddElements { set, elements } => element_messages(family, set, elements.iter(), false)?,
        Op::DeleteElements { set, keys } => {
            element_messages(family, set, keys.iter().map(|k| (*k, None)), true)?
        }
    })
}

/// Appends one netlink message to `buf`; returns its length.
pub(super) fn push_message(
    buf: &mut Vec<u8>,
    header: NetfilterHeader,
    inner: NetfilterMessageInner,
    flags: u16,
    seq: u32,
) -> usize {
    let mut msg = NetlinkMessage::from(NetfilterMessage::new(header, inner));
    msg.header.flags = NLM_F_REQUEST | flags;
    msg.header.sequence_number = seq;
    msg.finalize();
    let len = msg.buffer_len();
    let start = buf.len();
    buf.resize(start + len, 0);
    msg.serialize(&mut buf[start..]);
    len
}

/// A whole transaction as one `NFNL_MSG_BATCH_BEGIN .. NFNL_MSG_BATCH_END` buffer.
pub(super) struct Batch {
    pub buf: Vec<u8>,
    /// Sequence number of `BATCH_BEGIN`; commands follow it, then `BATCH_END`.
    pub begin_seq: u32,
    /// Index into the transaction's ops of each command message, in sequence order.
    pub op_of_message: Vec<usize>,
}

impl Batch {
    pub fn command_seq(&self, i: usize) -> u32 {
        self.begin_seq.wrapping_add(1).wrapping_add(i as u32)
    }

    pub fn last_command_seq(&self) -> u32 {
        self.command_seq(self.op_of_message.len() - 1)
    }

    pub fn end_seq(&self) -> u32 {
        self.command_seq(self.op_of_message.len())
    }

    /// The op that produced the message with sequence number `seq`, if any.
    pub fn op_of_seq(&self, seq: u32) -> Option<usize> {
        let i = seq.wrapping_sub(self.begin_seq).checked_sub(1)? as usize;
        self.op_of_message.get(i).copied()
    }

    /// Number of netlink messages, `BATCH_BEGIN` and `BATCH_END` included.
    pub fn messages(&self) -> usize {
        self.op_of_message.len() + 2
    }
}

/// Why an op could not be encoded: its index and the reason.
pub(super) struct EncodeError {
    pub index: usize,
    pub reason: String,
}

/// A batch that deletes table `name` of `family`: someone else's table, such as kube-proxy's
/// (`nftproxy cleanup --kube-proxy`). The one command asks for an ACK.
pub(super) fn encode_delete_named_table(family: Family, name: &str, begin_seq: u32) -> Batch {
    let delete = NfTablesMessage::DeleteTable(TableMessage {
        attributes: vec![TableAttribute::Name(name.to_string())],
    });
    batch_of(family, vec![delete], begin_seq)
}

/// A batch that deletes the elements with keys `keys` (raw key bytes) from `set`, in messages
/// that stay below the attribute limit. The last command asks for an ACK.
pub(super) fn encode_delete_elements(
    family: Family,
    set: &str,
    keys: &[Vec<u8>],
    begin_seq: u32,
) -> Batch {
    let mut lists: Vec<Vec<u8>> = vec![Vec::new()];
    for key in keys {
        if lists
            .last()
            .is_some_and(|l| l.len() > ELEMENT_LIST_TARGET_BYTES)
        {
            lists.push(Vec::new());
        }
        let list = lists.last_mut().expect("one list");
        put_nested(list, NFTA_LIST_ELEM, |out| {
            put_nested(out, NFTA_SET_ELEM_KEY, |out| {
                put_attr(out, NFTA_DATA_VALUE, key)
            })
        });
    }
    let messages = lists
        .into_iter()
        .map(|list| NfTablesMessage::DeleteSetElement(element_list(set, list)))
        .collect();
    batch_of(family, messages, begin_seq)
}

/// A batch of `messages` (at least one) outside any transaction of the planner: only the last
/// asks for an ACK.
fn batch_of(family: Family, messages: Vec<NfTablesMessage>, begin_seq: u32) -> Batch {
    let batch_header =
        || NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES);
    let mut buf = Vec::new();
    push_message(
        &mut buf,
        batch_header(),
        ControlMessage::BatchBegin.into(),
        0,
        begin_seq,
    );
    let n = messages.len();
    for (i, msg) in messages.into_iter().enumerate() {
        let ack = if i + 1 == n { NLM_F_ACK } else { 0 };
        push_message(
            &mut buf,
            NetfilterHeader::new(nfproto(family), 0, 0),
            msg.into(),
            ack,
            begin_seq.wrapping_add(1 + i as u32),
        );
    }
    push_message(
        &mut buf,
        batch_header(),
        ControlMessage::BatchEnd.into(),
        0,
        begin_seq.wrapping_add(1 + n as u32),
    );
    Batch {
        buf,
        begin_seq,
        op_of_message: vec![0; n],
    }
}

/// Roughly what an op encodes to, so that the batch buffer of a cold sync (tens of MiB) is
/// allocated once instead of being copied as it grows.
fn estimated_bytes(op: &Op) -> usize {
    match op {
        Op::AddRules { rules, .. } => rules.len() * 384,
        Op::AddElements { elements, .. } => elements.len() * 64 + 200,
        _ => 200,
    }
}

/// Encodes a non-empty transaction. Only the last command asks for an ACK: the kernel reports
/// every failing message anyway, and one ACK per message would flood the receive buffer.
pub(super) fn encode_transaction(tx: &Transaction, begin_seq: u32) -> Result<Batch, EncodeError> {
    let family = nfproto(tx.family);
    let batch_header =
        || NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES);
    let mut buf = Vec::with_capacity(tx.ops.iter().map(estimated_bytes).sum::<usize>() + 64);
    push_message(
        &mut buf,
        batch_header(),
        ControlMessage::BatchBegin.into(),
        0,
        begin_seq,
    );
    // Ops are serialised one at a time so that only one op's message trees exist at once; the
    // previous command waits in `pending` because only the very last one asks for an ACK.
    let mut next_set_id = 0;
    let mut op_of_message = Vec::with_capacity(tx.ops.len());
    let mut pending: Option<(usize, Command)> = None;
    let mut push = |buf: &mut Vec<u8>, index: usize, cmd: Command, ack: u16| {
        let seq = begin_seq
            .wrapping_add(1)
            .wrapping_add(op_of_message.len() as u32);
        let len = push_message(
            buf,
            NetfilterHeader::new(family, 0, 0),
            cmd.msg.into(),
            cmd.flags | ack,
            seq,
        );
        op_of_message.push(index);
        if len > MAX_MESSAGE_BYTES {
            return Err(EncodeError {
                index,
                reason: format!(
                    "message of {len} bytes exceeds the 64 KiB netlink attribute limit"
                ),
            });
        }
        Ok(())
    };
    for (index, op) in tx.ops.iter().enumerate() {
        let cmds = encode_op(tx.family, op, &mut next_set_id)
            .map_err(|reason| EncodeError { index, reason })?;
        for cmd in cmds {
            if let Some((i, previous)) = pending.replace((index, cmd)) {
                push(&mut buf, i, previous, 0)?;
            }
        }
    }
    if let Some((i, last)) = pending {
        push(&mut buf, i, last, NLM_F_ACK)?;
    }
    let end_seq = begin_seq
        .wrapping_add(1)
        .wrapping_add(op_of_message.len() as u32);
    push_message(
        &mut buf,
        batch_header(),
        ControlMessage::BatchEnd.into(),
        0,
        end_seq,
    );
    Ok(Batch {
        buf,
        begin_seq,
        op_of_message,
    })
}

/// The netlink messages of `tx` (`BATCH_BEGIN`, the commands, `BATCH_END`), each with its
/// header. Public (hidden) for the fuzz tests, which decode and mutate real messages.
#[doc(hidden)]
pub fn transaction_messages(tx: &Transaction) -> Result<Vec<Vec<u8>>, String> {
    let batch = encode_transaction(tx, 0).map_err(|e| e.reason)?;
    let mut out = Vec::new();
    let mut rest = batch.buf.as_slice();
    while rest.len() >= 4 {
        let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let len = len.clamp(4, rest.len());
        out.push(rest[..len].to_vec());
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
    }
    Ok(out)
}
