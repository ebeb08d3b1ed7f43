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
    Action, BaseChain, ChainType, Family, Hook, Key, KeyType, Match, Rule, SLOT_MODULUS, SetDecl,
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
const IPHDR_DADDR: u32 = 12;
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

pub(super) fn nfproto(family: Family) -> NetfilterProtoFamily {
    match family {
        Family::V4 => NetfilterProtoFamily::IPv4,
        Family::V6 => NetfilterProtoFamily::IPv6,
    }
}

/// Offsets of the source and destination address in the network header, and their length.
pub(super) fn addr_layout(family: Family) -> (u32, u32, u32) {
    match family {
        Family::V4 => (12, 16, 4),
        Family::V6 => (8, 24, 16),
    }
}

pub(super) fn hook_number(hook: Hook) -> InetHookNumber {
    match hook {
        Hook::Prerouting => InetHookNumber::PreRouting,
        Hook::Input => InetHookNumber::LocalIn,
        Hook::Forward => InetHookNumber::Forward,
        Hook::Output => InetHookNumber::LocalOut,
        Hook::Postrouting => InetHookNumber::PostRouting,
    }
}

pub(super) fn chain_type_name(t: ChainType) -> &'static str {
    match t {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    }
}

fn addr_type(family: Family) -> (u32, u32) {
    match family {
        Family::V4 => (TYPE_IPV4_ADDR, 4),
        Family::V6 => (TYPE_IPV6_ADDR, 16),
    }
}

fn concat(types: &[u32]) -> u32 {
    types.iter().fold(0, |acc, t| (acc << CONCAT_TYPE_BITS) | t)
}

/// `NFTA_SET_KEY_TYPE` and `NFTA_SET_KEY_LEN` of a key type. Concatenated fields are each padded
/// to 4 bytes, the width of the 32-bit registers they are loaded into.
pub(super) fn key_layout(family: Family, key: KeyType) -> (u32, u32) {
    let (addr_type, addr_len) = addr_type(family);
    match key {
        KeyType::Addr => (addr_type, addr_len),
        KeyType::AddrProtoPort => (
            concat(&[addr_type, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            addr_len + 8,
        ),
        KeyType::ProtoPort => (concat(&[TYPE_INET_PROTO, TYPE_INET_SERVICE]), 8),
        KeyType::AddrPair => (concat(&[addr_type, addr_type]), 2 * addr_len),
        // A `numgen` value, big-endian in the map (the rule converts it with `byteorder`).
        KeyType::Slot => (TYPE_INTEGER, 4),
        // The index is the `numgen` value as the rule computes it: host-endian.
        KeyType::AddrProtoPortIndex => (
            concat(&[addr_type, TYPE_INET_PROTO, TYPE_INET_SERVICE, TYPE_INTEGER]),
            addr_len + 12,
        ),
        KeyType::ProtoPortIndex => (
            concat(&[TYPE_INET_PROTO, TYPE_INET_SERVICE, TYPE_INTEGER]),
            12,
        ),
    }
}

/// `NFTA_SET_DATA_TYPE` and `NFTA_SET_DATA_LEN` of maps to endpoints (endpoint maps and
/// endpoint lists): `ADDR . inet_service`, the port padded to 4 bytes.
pub(super) fn endpoint_data_layout(family: Family) -> (u32, u32) {
    let (addr_type, addr_len) = addr_type(family);
    (concat(&[addr_type, TYPE_INET_SERVICE]), addr_len + 4)
}

/// An endpoint as map data (of an endpoint-list entry or an endpoint-map interval start): the
/// address, then the port (big-endian) padded to 4 bytes, as `nat` reads them from consecutive
/// registers.
pub(super) fn endpoint_data(family: Family, addr: &IpAddr, port: u16) -> Result<Vec<u8>, String> {
    check_family(family, addr)?;
    let mut out = addr_bytes(addr);
    out.extend_from_slice(&port.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    Ok(out)
}

/// One libnftnl user-data TLV.
fn tlv(out: &mut Vec<u8>, kind: u8, value: &[u8]) {
    out.push(kind);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

/// A TLV holding a host-endian u32, as `nftnl_udata_put_u32` writes it.
fn tlv_u32(out: &mut Vec<u8>, kind: u8, value: u32) {
    tlv(out, kind, &value.to_ne_bytes());
}

/// nft's `typeof` description of one expression: its kind, then its own TLVs.
fn typeof_expr(kind: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_TYPEOF_EXPR, kind);
    tlv(&mut out, UDATA_TYPEOF_DATA, data);
    out
}

fn typeof_numgen(modulus: u32) -> Vec<u8> {
    let mut numgen = Vec::new();
    tlv_u32(&mut numgen, 0, NFT_NG_RANDOM); // NFTNL_UDATA_NUMGEN_TYPE
    tlv_u32(&mut numgen, 1, modulus); // NFTNL_UDATA_NUMGEN_MODULUS
    tlv_u32(&mut numgen, 2, 0); // NFTNL_UDATA_NUMGEN_OFFSET
    typeof_expr(EXPR_NUMGEN, &numgen)
}

fn typeof_daddr(family: Family) -> Vec<u8> {
    match family {
        Family::V4 => typeof_payload(PROTO_DESC_IP, IPHDR_DADDR),
        Family::V6 => typeof_payload(PROTO_DESC_IP6, IP6HDR_DADDR),
    }
}

/// A concatenation; its members are TLVs numbered from 0.
fn typeof_concat(members: &[Vec<u8>]) -> Vec<u8> {
    let mut data = Vec::new();
    for (i, m) in (0u8..).zip(members) {
        tlv(&mut data, i, m);
    }
    typeof_expr(EXPR_CONCAT, &data)
}

/// The `typeof` of an endpoint map's data: `ip daddr . th dport`.
fn typeof_endpoint(family: Family) -> Vec<u8> {
    typeof_concat(&[
        typeof_daddr(family),
        typeof_payload(PROTO_DESC_TH, THDR_DPORT),
    ])
}

/// The set user data nft 1.0.6 writes for an endpoint-list map, `typeof [ip daddr .] meta
/// l4proto . th dport . numgen random mod 2 : ip daddr . th dport`.
fn list_udata(family: Family, nodeport: bool) -> Vec<u8> {
    let mut key = Vec::new();
    if !nodeport {
        key.push(typeof_daddr(family));
    }
    let mut l4proto = Vec::new();
    tlv_u32(&mut l4proto, 0, MetaKey::L4Proto.into()); // NFTNL_UDATA_META_KEY
    key.push(typeof_expr(EXPR_META, &l4proto));
    key.push(typeof_payload(PROTO_DESC_TH, THDR_DPORT));
    key.push(typeof_numgen(2));
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_SET_KEYBYTEORDER, BYTEORDER_INVALID);
    tlv_u32(&mut out, UDATA_SET_DATABYTEORDER, BYTEORDER_INVALID);
    tlv(&mut out, UDATA_SET_KEY_TYPEOF, &typeof_concat(&key));
    tlv(&mut out, UDATA_SET_DATA_TYPEOF, &typeof_endpoint(family));
    tlv_u32(&mut out, UDATA_SET_DATA_INTERVAL, 0);
    out
}

fn typeof_payload(desc: u32, field: u32) -> Vec<u8> {
    let mut data = Vec::new();
    tlv_u32(&mut data, 0, desc);
    tlv_u32(&mut data, 1, field);
    typeof_expr(EXPR_PAYLOAD, &data)
}

/// The set user data nft 1.0.6 writes for `typeof numgen random mod 2 : ip daddr . th dport`,
/// `flags interval` (100 bytes for both families): the key and data byte orders, the two
/// `typeof` expressions, and "data is not an interval". `nft list` prints the map from it.
fn slot_udata(family: Family) -> Vec<u8> {
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_SET_KEYBYTEORDER, BYTEORDER_HOST_ENDIAN);
    tlv_u32(&mut out, UDATA_SET_DATABYTEORDER, BYTEORDER_INVALID);
    tlv(&mut out, UDATA_SET_KEY_TYPEOF, &typeof_numgen(2));
    tlv(&mut out, UDATA_SET_DATA_TYPEOF, &typeof_endpoint(family));
    tlv_u32(&mut out, UDATA_SET_DATA_INTERVAL, 0);
    out
}

fn addr_bytes(addr: &IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn check_family(family: Family, addr: &IpAddr) -> Result<(), String> {
    if Family::of(addr) == family {
        Ok(())
    } else {
        Err(format!(
            "address {addr} does not belong in a table of family {}",
            family.nft_name()
        ))
    }
}

/// The bytes of a set element key: fields in order, protocol and port each padded to 4 bytes.
pub(super) fn key_bytes(family: Family, key: &Key) -> Result<Vec<u8>, String> {
    let proto_port = |out: &mut Vec<u8>, proto: dataplane::nft::ruleset::Proto, port: u16| {
        out.extend_from_slice(&[proto.number(), 0, 0, 0]);
        out.extend_from_slice(&port.to_be_bytes());
        out.extend_from_slice(&[0, 0]);
    };
    let mut out = Vec::with_capacity(24);
    match key {
        Key::Addr(a) => {
            check_family(family, a)?;
            out.extend(addr_bytes(a));
        }
        Key::AddrProtoPort(a, proto, port) => {
            check_family(family, a)?;
            out.extend(addr_bytes(a));
            proto_port(&mut out, *proto, *port);
        }
        Key::ProtoPort(proto, port) => proto_port(&mut out, *proto, *port),
        Key::AddrPair(a) => {
            check_family(family, a)?;
            out.extend(addr_bytes(a));
            out.extend(addr_bytes(a));
        }
        Key::Slot { at, .. } => out.extend_from_slice(&at.to_be_bytes()),
        Key::AddrProtoPortIndex(a, proto, port, i) => {
            check_family(family, a)?;
            out.extend(addr_bytes(a));
            proto_port(&mut out, *proto, *port);
            out.extend_from_slice(&u32::from(*i).to_ne_bytes());
        }
        Key::ProtoPortIndex(proto, port, i) => {
            proto_port(&mut out, *proto, *port);
            out.extend_from_slice(&u32::from(*i).to_ne_bytes());
        }
    }
    Ok(out)
}

pub(super) fn verdict_attrs(v: &Verdict) -> Vec<VerdictAttribute> {
    match v {
        Verdict::Accept => vec![VerdictAttribute::Code(NlVerdict::Other(NF_ACCEPT))],
        Verdict::Drop => vec![VerdictAttribute::Code(NlVerdict::Other(NF_DROP))],
        Verdict::Return => vec![VerdictAttribute::Code(NlVerdict::Return)],
        Verdict::Jump(c) => vec![
            VerdictAttribute::Code(NlVerdict::Jump),
            VerdictAttribute::Chain(c.to_string()),
        ],
        Verdict::Goto(c) => vec![
            VerdictAttribute::Code(NlVerdict::Goto),
            VerdictAttribute::Chain(c.to_string()),
        ],
    }
}

/// One libnftnl user-data TLV holding a NUL-terminated string.
fn udata_string(kind: u8, text: &str) -> Result<Vec<u8>, String> {
    if text.contains('\0') {
        return Err("comment contains a NUL byte".to_string());
    }
    let len = text.len() + 1;
    // The TLV length is one byte, and the kernel caps the whole user data at 256 bytes.
    if len > usize::from(u8::MAX) || len + 2 > USERDATA_MAXLEN {
        return Err(format!(
            "comment of {} bytes is longer than nftables allows (254)",
            text.len()
        ));
    }
    let mut out = Vec::with_capacity(len + 2);
    out.push(kind);
    out.push(len as u8);
    out.extend_from_slice(text.as_bytes());
    out.push(0);
    Ok(out)
}

fn u32_attr(kind: u16, value: u32) -> DefaultNla {
    DefaultNla::new(kind, value.to_be_bytes().to_vec())
}

fn str_attr(kind: u16, value: &str) -> DefaultNla {
    let mut bytes = Vec::with_capacity(value.len() + 1);
    bytes.extend_from_slice(value.as_bytes());
    bytes.push(0);
    DefaultNla::new(kind, bytes)
}

type Expr = ListAttribute<ExpressionAttribute>;

fn other(name: &str, attributes: Vec<DefaultNla>) -> Expr {
    Expressions::Other {
        expression_type: name.to_string(),
        attributes,
    }
    .into()
}

fn payload(base: u32, offset: u32, len: u32, dreg: Register) -> Expr {
    Expressions::Payload(vec![
        Payload::DestinationRegister(dreg),
        Payload::Base(base),
        Payload::Offset(offset),
        Payload::Len(len),
    ])
    .into()
}

fn cmp(op: Operator, data: Vec<u8>) -> Expr {
    Expressions::Cmp(vec![
        Cmp::SourceRegister(Register::Reg1),
        Cmp::Op(op),
        Cmp::Data(DataAttribute::Value(data)),
    ])
    .into()
}

fn bitwise(mask: Vec<u8>, xor: Vec<u8>) -> Expr {
    Expressions::Bitwise(vec![
        Bitwise::SourceRegister(Register::Reg1),
        Bitwise::DestinationRegister(Register::Reg1),
        Bitwise::Length(mask.len() as u32),
        Bitwise::Mask(DataAttribute::Value(mask)),
        Bitwise::Xor(DataAttribute::Value(xor)),
    ])
    .into()
}

fn meta_load(key: MetaKey, dreg: Register) -> Expr {
    Expressions::Meta(vec![Meta::Key(key), Meta::DestinationRegister(dreg)]).into()
}

fn immediate(dreg: Register, data: DataAttribute) -> Expr {
    Expressions::Immediate(vec![
        Immediate::DestinationRegister(dreg),
        Immediate::Data(data),
    ])
    .into()
}

fn lookup(set: &str, sreg: Register, dreg: Option<Register>) -> Expr {
    let mut attrs = vec![Lookup::Set(set.to_string()), Lookup::SourceRegister(sreg)];
    if let Some(dreg) = dreg {
        attrs.push(Lookup::DestinationRegister(dreg));
    }
    Expressions::Lookup(attrs).into()
}

fn op_of(negate: bool) -> Operator {
    if negate {
        Operator::NotEqual
    } else {
        Operator::Equal
    }
}

/// `ip daddr [!=] NET`: an exact compare for a host, a masked compare for a prefix.
fn addr_match(family: Family, net: &IpNet, dest: bool, negate: bool, out: &mut Vec<Expr>) {
    let (saddr_off, daddr_off, len) = addr_layout(family);
    let offset = if dest { daddr_off } else { saddr_off };
    out.push(payload(
        NFT_PAYLOAD_NETWORK_HEADER,
        offset,
        len,
        Register::Reg1,
    ));
    if net.prefix_len() != net.max_prefix_len() {
        out.push(bitwise(addr_bytes(&net.netmask()), vec![0; len as usize]));
    }
    out.push(cmp(op_of(negate), addr_bytes(&net.trunc().addr())));
}

const IFNAMSIZ: usize = 16;

fn match_exprs(family: Family, m: &Match, out: &mut Vec<Expr>) -> Result<(), String> {
    let (saddr_off, daddr_off, alen) = addr_layout(family);
    match m {
        Match::CtStateNew => {
            out.push(other(
                "ct",
                vec![
                    u32_attr(NFTA_CT_DREG, Register::Reg1.into()),
                    u32_attr(NFTA_CT_KEY, NFT_CT_STATE),
                ],
            ));
            // ct state is a host-endian bit field, tested like nft does: state & new != 0.
            out.push(bitwise(CT_STATE_NEW_BIT.to_ne_bytes().to_vec(), vec![0; 4]));
            out.push(cmp(Operator::NotEqual, vec![0; 4]));
        }
        Match::CtStatusDnat => {
            out.push(other(
                "ct",
                vec![
                    u32_attr(NFTA_CT_DREG, Register::Reg1.into()),
                    u32_attr(NFTA_CT_KEY, NFT_CT_STATUS),
                ],
            ));
            // ct status is a host-endian bit field too: status & dnat != 0.
            out.push(bitwise(
                CT_STATUS_DNAT_BIT.to_ne_bytes().to_vec(),
                vec![0; 4],
            ));
            out.push(cmp(Operator::NotEqual, vec![0; 4]));
        }
        Match::SaddrDaddrInSet { set } => {
            out.push(payload(
                NFT_PAYLOAD_NETWORK_HEADER,
                saddr_off,
                alen,
                reg32(0),
            ));
            out.push(payload(
                NFT_PAYLOAD_NETWORK_HEADER,
                daddr_off,
                alen,
                reg32(alen / 4),
            ));
            out.push(lookup(set, reg32(0), None));
        }
        Match::Daddr { net, negate } | Match::Saddr { net, negate } => {
            check_family(family, &net.addr())?;
            let dest = matches!(m, Match::Daddr { .. });
            addr_match(family, net, dest, *negate, out);
        }
        Match::DaddrInSet { set } | Match::SaddrInSet { set } => {
            let offset = if matches!(m, Match::DaddrInSet { .. }) {
                daddr_off
            } else {
                saddr_off
            };
            out.push(payload(
                NFT_PAYLOAD_NETWORK_HEADER,
                offset,
                alen,
                Register::Reg1,
            ));
            out.push(lookup(set, Register::Reg1, None));
        }
        Match::FibSaddrLocal | Match::FibDaddrLocal => {
            let flags = if matches!(m, Match::FibSaddrLocal) {
                NFTA_FIB_F_SADDR
            } else {
                NFTA_FIB_F_DADDR
            };
            out.push(other(
                "fib",
                vec![
                    u32_attr(NFTA_FIB_DREG, Register::Reg1.into()),
                    u32_attr(NFTA_FIB_RESULT, NFT_FIB_RESULT_ADDRTYPE),
                    u32_attr(NFTA_FIB_FLAGS, flags),
                ],
            ));
            out.push(cmp(Operator::Equal, RTN_LOCAL.to_ne_bytes().to_vec()));
        }
        Match::AddrProtoPortInSet { set } => {
            addr_proto_port(family, out);
            out.push(lookup(set, Register::Reg1, None));
        }
        Match::ProtoPortInSet { set } => {
            proto_port_load(0, out);
            out.push(lookup(set, Register::Reg1, None));
        }
        Match::L4Proto(p) => {
            out.push(meta_load(MetaKey::L4Proto, Register::Reg1));
            out.push(cmp(Operator::Equal, vec![p.number()]));
        }
        Match::Numgen { modulus, value } => {
            if *modulus == 0 || value >= modulus {
                return Err(format!(
                    "numgen value {value} is not below modulus {modulus}"
                ));
            }
            out.push(numgen(Register::Reg1, *modulus, None));
            // numgen writes a host-endian u32.
            out.push(cmp(Operator::Equal, value.to_ne_bytes().to_vec()));
        }
        Match::MarkUnset { mask } => {
            out.push(meta_load(MetaKey::Mark, Register::Reg1));
            out.push(bitwise(mask.to_ne_bytes().to_vec(), vec![0; 4]));
            out.push(cmp(Operator::Equal, vec![0; 4]));
        }
        Match::IifName {
            name,
            prefix,
            negate,
        } => {
            if name.is_empty() || name.len() >= IFNAMSIZ || name.contains('\0') {
                return Err(format!("invalid interface name {name:?}"));
            }
            out.push(meta_load(MetaKey::Iifname, Register::Reg1));
            let mut data = name.as_bytes().to_vec();
            if !prefix {
                // An exact name compares the whole NUL-padded IFNAMSIZ buffer, as nft does.
                data.resize(IFNAMSIZ, 0);
            }
            out.push(cmp(op_of(*negate), data));
        }
    }
    Ok(())
}

/// `numgen random mod modulus [offset offset]` into `dreg`.
fn numgen(dreg: Register, modulus: u32, offset: Option<u32>) -> Expr {
    let mut attrs = vec![
        u32_attr(NFTA_NG_DREG, dreg.into()),
        u32_attr(NFTA_NG_MODULUS, modulus),
        u32_attr(NFTA_NG_TYPE, NFT_NG_RANDOM),
    ];
    attrs.extend(offset.map(|o| u32_attr(NFTA_NG_OFFSET, o)));
    other("numgen", attrs)
}

/// `nat dnat` to the address in reg 1 and the port in `proto_reg`, with nft's flags if any.
fn dnat(family: Family, proto_reg: Register, flags: Option<u32>) -> Expr {
    let mut attrs = vec![
        u32_attr(NFTA_NAT_TYPE, NFT_NAT_DNAT),
        u32_attr(NFTA_NAT_FAMILY, u8::from(nfproto(family)).into()),
        u32_attr(NFTA_NAT_REG_ADDR_MIN, Register::Reg1.into()),
        u32_attr(NFTA_NAT_REG_PROTO_MIN, proto_reg.into()),
    ];
    attrs.extend(flags.map(|f| u32_attr(NFTA_NAT_FLAGS, f)));
    other("nat", attrs)
}

/// 32-bit register `n` (`NFT_REG32_00 + n`): concatenations are loaded field after field into
/// consecutive 32-bit registers.
fn reg32(n: u32) -> Register {
    Register::from(8 + n)
}

/// The register nft names for 32-bit word `n`: the 16-byte register holding it when the word
/// starts one (`reg 1` for word 0), else the 32-bit register.
fn nft_reg(n: u32) -> Register {
    if n.is_multiple_of(4) {
        Register::from(1 + n / 4)
    } else {
        reg32(n)
    }
}

/// Loads `meta l4proto . th dport` into the words from `word` on.
fn proto_port_load(word: u32, out: &mut Vec<Expr>) {
    out.push(meta_load(MetaKey::L4Proto, nft_reg(word)));
    out.push(payload(
        NFT_PAYLOAD_TRANSPORT_HEADER,
        2,
        2,
        nft_reg(word + 1),
    ));
}

/// Loads `ip daddr . meta l4proto . th dport` from word 0 on; returns the next free word.
fn addr_proto_port(family: Family, out: &mut Vec<Expr>) -> u32 {
    let (_, daddr_off, alen) = addr_layout(family);
    out.push(payload(
        NFT_PAYLOAD_NETWORK_HEADER,
        daddr_off,
        alen,
        Register::Reg1,
    ));
    proto_port_load(alen / 4, out);
    alen / 4 + 2
}

fn action_exprs(family: Family, action: &Action, out: &mut Vec<Expr>) -> Result<(), String> {
    let (saddr_off, daddr_off, alen) = addr_layout(family);
    match action {
        Action::Verdict(v) => out.push(immediate(
            Register::Verdict,
            DataAttribute::Verdict(verdict_attrs(v)),
        )),
        Action::VmapAddrProtoPort { map } => {
            let words = alen / 4;
            out.push(payload(
                NFT_PAYLOAD_NETWORK_HEADER,
                daddr_off,
                alen,
                reg32(0),
            ));
            out.push(meta_load(MetaKey::L4Proto, reg32(words)));
            out.push(payload(
                NFT_PAYLOAD_TRANSPORT_HEADER,
                2,
                2,
                reg32(words + 1),
            ));
            out.push(lookup(map, reg32(0), Some(Register::Verdict)));
        }
        Action::VmapProtoPort { map } => {
            out.push(meta_load(MetaKey::L4Proto, reg32(0)));
            out.push(payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, reg32(1)));
            out.push(lookup(map, reg32(0), Some(Register::Verdict)));
        }
        Action::Reject => {
            let code = match family {
                Family::V4 => ICMP_PORT_UNREACH,
                Family::V6 => ICMPV6_PORT_UNREACH,
            };
            out.push(other(
                "reject",
                vec![
                    u32_attr(NFTA_REJECT_TYPE, NFT_REJECT_ICMP_UNREACH),
                    DefaultNla::new(NFTA_REJECT_ICMP_CODE, vec![code]),
                ],
            ));
        }
        Action::Dnat { addr, port } => {
            check_family(family, addr)?;
            out.push(immediate(
                Register::Reg1,
                DataAttribute::Value(addr_bytes(addr)),
            ));
            out.push(immediate(
                Register::Reg2,
                DataAttribute::Value(port.to_be_bytes().to_vec()),
            ));
            out.push(dnat(
                family,
                Register::Reg2,
                Some(NF_NAT_RANGE_PROTO_SPECIFIED),
            ));
        }
        Action::DnatSlot { map, offset } => {
            if offset.checked_add(SLOT_MODULUS - 1).is_none() {
                return Err(format!("numgen offset {offset} overflows"));
            }
            out.push(numgen(Register::Reg1, SLOT_MODULUS, Some(*offset)));
            // numgen writes a host-endian u32; the map's keys are big-endian.
            out.push(other(
                "byteorder",
                vec![
                    u32_attr(NFTA_BYTEORDER_SREG, Register::Reg1.into()),
                    u32_attr(NFTA_BYTEORDER_DREG, Register::Reg1.into()),
                    u32_attr(NFTA_BYTEORDER_OP, NFT_BYTEORDER_HTON),
                    u32_attr(NFTA_BYTEORDER_LEN, 4),
                    u32_attr(NFTA_BYTEORDER_SIZE, 4),
                ],
            ));
            // The endpoint (address . port) lands in the registers from reg 1 on: the port in
            // the word after the address (reg 9 = NFT_REG32_01 for IPv4, reg 2 for IPv6, the
            // registers nft picks). The kernel adds MAP_IPS | PROTO_SPECIFIED itself.
            out.push(lookup(map, Register::Reg1, Some(Register::Reg1)));
            out.push(dnat(family, nft_reg(alen / 4), None));
        }
        Action::DnatIndexed {
            map,
            nodeport,
            modulus,
        } => {
            if *modulus == 0 {
                return Err("numgen modulus 0".to_string());
            }
            let word = if *nodeport {
                proto_port_load(0, out);
                2
            } else {
                addr_proto_port(family, out)
            };
            out.push(numgen(nft_reg(word), *modulus, None));
            // The endpoint (address . port) lands in the words from 0 on, as in DnatSlot.
            out.push(lookup(map, Register::Reg1, Some(Register::Reg1)));
            out.push(dnat(family, nft_reg(alen / 4), None));
        }
        Action::Masquerade => out.push(other(
            "masq",
            vec![u32_attr(NFTA_MASQ_FLAGS, NF_NAT_RANGE_PROTO_RANDOM_FULLY)],
        )),
        Action::MarkOr(bits) | Action::MarkXor(bits) => {
            // mark | bits == (mark & !bits) ^ bits; mark ^ bits == (mark & all) ^ bits.
            let mask = if matches!(action, Action::MarkOr(_)) {
                !bits
            } else {
                u32::MAX
            };
            out.push(meta_load(MetaKey::Mark, Register::Reg1));
            out.push(bitwise(
                mask.to_ne_bytes().to_vec(),
                bits.to_ne_bytes().to_vec(),
            ));
            out.push(
                Expressions::Meta(vec![
                    Meta::Key(MetaKey::Mark),
                    Meta::SourceRegister(Register::Reg1),
                ])
                .into(),
            );
        }
        Action::UpdateSaddr { set } => {
            out.push(payload(
                NFT_PAYLOAD_NETWORK_HEADER,
                saddr_off,
                alen,
                Register::Reg1,
            ));
            out.push(other(
                "dynset",
                vec![
                    str_attr(NFTA_DYNSET_SET_NAME, set),
                    u32_attr(NFTA_DYNSET_OP, NFT_DYNSET_OP_UPDATE),
                    u32_attr(NFTA_DYNSET_SREG_KEY, Register::Reg1.into()),
                ],
            ));
        }
    }
    Ok(())
}

/// The expression list of a rule.
pub(super) fn rule_exprs(family: Family, rule: &Rule) -> Result<Vec<Expr>, String> {
    let mut out = Vec::with_capacity(rule.matches.len() * 3 + 4);
    for m in &rule.matches {
        match_exprs(family, m, &mut out)?;
    }
    action_exprs(family, &rule.action, &mut out)?;
    Ok(out)
}

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
    if endpoint_map && (decl.is_vmap || decl.timeout_secs.is_some()) {
        return Err(format!(
            "endpoint map {name} cannot be a verdict map or have a timeout"
        ));
    }
    let (key_type, key_len) = key_layout(family, decl.key);
    let mut flags = SetFlags::empty();
    if decl.is_vmap || endpoint_map {
        flags |= SetFlags::Map;
    }
    if decl.key == KeyType::Slot {
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
    // What nft writes, so that `nft list` output is identical: the key byte order of address
    // sets (without it nft still prints them), the `typeof` of endpoint maps (without it nft
    // cannot print them).
    let mut udata = match decl.key {
        KeyType::Addr => {
            let mut u = Vec::new();
            tlv_u32(&mut u, UDATA_SET_KEYBYTEORDER, BYTEORDER_BIG_ENDIAN);
            u
        }
        KeyType::Slot => slot_udata(family),
        KeyType::AddrProtoPortIndex => list_udata(family, false),
        KeyType::ProtoPortIndex => list_udata(family, true),
        _ => Vec::new(),
    };
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
fn element_messages<'e>(
    family: Family,
    set: &str,
    elements: impl Iterator<Item = (&'e Key, Option<&'e Value>)>,
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
            msg: make(SetElementMessage {
                attributes: vec![
                    SetElementList::Table(TABLE.to_string()),
                    SetElementList::Set(set.to_string()),
                    SetElementList::Other(DefaultNla::new(
                        NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED,
                        list,
                    )),
                ],
            }),
            flags,
        });
    };
    let mut list = Vec::with_capacity(ELEMENT_LIST_TARGET_BYTES + 512);
    for (key, value) in elements {
        let before = list.len();
        put_elements(family, key, value, delete, &mut list)?;
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
        (Some(Value::Verdict(v)), false) => Some(Err(v)),
    };
    if matches!(key, Key::Slot { .. }) && data.is_none() && !delete {
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
    if let Key::Slot { end, .. } = key {
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
        Op::AddElements { set, elements } => element_messages(
            family,
            set,
            elements.iter().map(|(k, v)| (k, v.as_ref())),
            false,
        )?,
        Op::DeleteElements { set, keys } => {
            element_messages(family, set, keys.iter().map(|k| (k, None)), true)?
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
    push_message(
        &mut buf,
        NetfilterHeader::new(nfproto(family), 0, 0),
        NfTablesMessage::DeleteTable(TableMessage {
            attributes: vec![TableAttribute::Name(name.to_string())],
        })
        .into(),
        NLM_F_ACK,
        begin_seq.wrapping_add(1),
    );
    push_message(
        &mut buf,
        batch_header(),
        ControlMessage::BatchEnd.into(),
        0,
        begin_seq.wrapping_add(2),
    );
    Batch {
        buf,
        begin_seq,
        op_of_message: vec![0],
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concat_key_types_match_nft() {
        assert_eq!(key_layout(Family::V4, KeyType::AddrProtoPort), (0x730d, 12));
        assert_eq!(key_layout(Family::V6, KeyType::AddrProtoPort), (0x830d, 24));
        assert_eq!(key_layout(Family::V4, KeyType::ProtoPort), (0x30d, 8));
        assert_eq!(key_layout(Family::V6, KeyType::Addr), (8, 16));
    }

    #[test]
    fn keys_are_padded_per_field() {
        let k = Key::AddrProtoPort(
            "10.0.0.1".parse().unwrap(),
            dataplane::nft::ruleset::Proto::Tcp,
            80,
        );
        assert_eq!(
            key_bytes(Family::V4, &k).unwrap(),
            vec![10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0]
        );
        assert!(key_bytes(Family::V6, &k).is_err());
    }

    fn hex(s: &str) -> Vec<u8> {
        s.split_whitespace()
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect()
    }

    /// The user data `nft -f` (1.0.6, x86_64) sent for `typeof numgen random mod 2 : ip daddr .
    /// th dport; flags interval`, captured with `nft --debug=mnl`.
    #[cfg(target_endian = "little")]
    #[test]
    fn endpoint_map_udata_is_nfts() {
        let common = "00 04 01 00 00 00 01 04 00 00 00 00 03 1a 00 04 17 00 00 00 01 12 00 04 \
                      01 00 00 00 01 04 02 00 00 00 02 04 00 00 00 00 04 34 00 04 0d 00 00 00 \
                      01 2c 00 14 00 04 07 00 00 00 01 0c 00 04";
        let tail = "01 14 00 04 07 00 00 00 01 0c 00 04 0b 00 00 00 01 04 02 00 00 00 06 04 \
                    00 00 00 00";
        let v4 = format!("{common} 0c 00 00 00 01 04 0c 00 00 00 {tail}");
        let v6 = format!("{common} 0d 00 00 00 01 04 09 00 00 00 {tail}");
        assert_eq!(slot_udata(Family::V4), hex(&v4));
        assert_eq!(slot_udata(Family::V6), hex(&v6));
        assert_eq!(slot_udata(Family::V4).len(), 100);
        assert_eq!(endpoint_data_layout(Family::V4), (0x1cd, 8));
        assert_eq!(endpoint_data_layout(Family::V6), (0x20d, 20));
    }

    #[test]
    fn endpoint_list_udata_is_nfts() {
        // What nft 1.0.6 sends for `typeof ip daddr . meta l4proto . th dport . numgen random
        // mod 2 : ip daddr . th dport` (captured with `nft --debug=mnl`), and the same without
        // `ip daddr .`.
        let v4 = "000400000000010400000000036000040d00000001580014000407000000010c00040c0000000104\
                  0c000000010e00040900000001060004100000000214000407000000010c00040b00000001040200\
                  0000031a0004170000000112000401000000010402000000020400000000043400040d000000012c\
                  0014000407000000010c00040c00000001040c0000000114000407000000010c00040b0000000104\
                  02000000060400000000";
        let nodeport = "000400000000010400000000034a00040d0000000142000e0004090000000106000410000000\
                        0114000407000000010c00040b000000010402000000021a00041700000001120004010000\
                        00010402000000020400000000043400040d000000012c0014000407000000010c00040c00\
                        000001040c0000000114000407000000010c00040b000000010402000000060400000000";
        let unspaced = |s: &str| -> Vec<u8> {
            let s: String = s.split_whitespace().collect();
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        assert_eq!(list_udata(Family::V4, false), unspaced(v4));
        assert_eq!(list_udata(Family::V4, true), unspaced(nodeport));
        assert_eq!(
            key_layout(Family::V4, KeyType::AddrProtoPortIndex),
            (0x1cc344, 16)
        );
        assert_eq!(
            key_layout(Family::V4, KeyType::ProtoPortIndex),
            (0xc344, 12)
        );
    }

    use dataplane::nft::ruleset::Proto;
    use netlink_packet_core::Emitable;
    use netlink_packet_netfilter::nftables::{SetElementAttribute, SetElementFlags};

    /// The crate's serialisation of element attributes, which [`put_elements`] must match.
    fn crate_bytes(elements: &[ListAttribute<SetElementAttribute>]) -> Vec<u8> {
        let mut out = Vec::new();
        for e in elements {
            let mut b = vec![0; e.buffer_len()];
            e.emit(&mut b);
            out.extend(b);
        }
        out
    }

    fn written(family: Family, key: &Key, value: Option<&Value>, delete: bool) -> Vec<u8> {
        let mut out = Vec::new();
        put_elements(family, key, value, delete, &mut out).unwrap();
        out
    }

    #[test]
    fn elements_are_written_as_the_crate_would() {
        let v4: IpAddr = "10.0.0.2".parse().unwrap();
        let v6: IpAddr = "fd00::2".parse().unwrap();
        let element = |key: Vec<u8>, data: Option<DataAttribute>| {
            let mut attrs = vec![SetElementAttribute::Key(DataAttribute::Value(key))];
            attrs.extend(data.map(SetElementAttribute::Data));
            ListAttribute::Element(attrs)
        };
        let verdicts = [
            Verdict::Accept,
            Verdict::Drop,
            Verdict::Return,
            Verdict::Jump("mark-for-masquerade".into()),
            Verdict::Goto("service-ABCDEFGH-ns/name/tcp/http".into()),
        ];
        for (family, addr) in [(Family::V4, v4), (Family::V6, v6)] {
            let keys = [
                Key::Addr(addr),
                Key::AddrPair(addr),
                Key::ProtoPort(Proto::Udp, 30053),
                Key::AddrProtoPort(addr, Proto::Sctp, 80),
            ];
            for key in &keys {
                let bytes = key_bytes(family, key).unwrap();
                let want = crate_bytes(&[element(bytes.clone(), None)]);
                assert_eq!(written(family, key, None, false), want, "{key:?}");
                assert_eq!(written(family, key, None, true), want, "{key:?}");
                for v in &verdicts {
                    let data = DataAttribute::Verdict(verdict_attrs(v));
                    let want = crate_bytes(&[element(bytes.clone(), Some(data))]);
                    let value = Value::Verdict(v.clone());
                    assert_eq!(written(family, key, Some(&value), false), want, "{v:?}");
                }
            }
            let endpoint = Value::Endpoint(addr, 8080);
            let data = endpoint_data(family, &addr, 8080).unwrap();
            for key in [
                Key::AddrProtoPortIndex(addr, Proto::Tcp, 80, 4),
                Key::ProtoPortIndex(Proto::Tcp, 30080, 0),
            ] {
                let bytes = key_bytes(family, &key).unwrap();
                let want = crate_bytes(&[element(
                    bytes.clone(),
                    Some(DataAttribute::Value(data.clone())),
                )]);
                assert_eq!(written(family, &key, Some(&endpoint), false), want);
                let want = crate_bytes(&[element(bytes, None)]);
                assert_eq!(written(family, &key, None, true), want);
            }
        }
        // An endpoint belongs only in an endpoint map.
        let mut out = Vec::new();
        let endpoint = Value::Endpoint(v4, 8080);
        assert!(
            put_elements(Family::V4, &Key::Addr(v4), Some(&endpoint), false, &mut out).is_err()
        );
    }

    #[test]
    fn slot_elements_are_big_endian_keys_with_padded_ports() {
        let interval = Key::Slot {
            at: 0x0048_cc40,
            end: 0x0048_cc50,
        };
        let endpoint = Value::Endpoint("10.0.0.2".parse().unwrap(), 8080);
        let added = written(Family::V4, &interval, Some(&endpoint), false);
        assert!(put_elements(Family::V4, &interval, None, false, &mut Vec::new()).is_err());
        let deleted = written(Family::V4, &interval, None, true);
        let start = |key: u32, data: Option<&str>| {
            let mut attrs = vec![SetElementAttribute::Key(DataAttribute::Value(
                key.to_be_bytes().to_vec(),
            ))];
            if let Some(d) = data {
                attrs.push(SetElementAttribute::Data(DataAttribute::Value(hex(d))));
            }
            ListAttribute::Element(attrs)
        };
        let end = ListAttribute::Element(vec![
            SetElementAttribute::Key(DataAttribute::Value(vec![0x00, 0x48, 0xcc, 0x50])),
            SetElementAttribute::Flags(SetElementFlags::IntervalEnd),
        ]);
        assert_eq!(
            added,
            crate_bytes(&[
                start(0x0048_cc40, Some("0a 00 00 02 1f 90 00 00")),
                end.clone()
            ])
        );
        assert_eq!(deleted, crate_bytes(&[start(0x0048_cc40, None), end]));
        assert_eq!(
            endpoint_data(Family::V4, &"10.0.0.2".parse().unwrap(), 8080).unwrap(),
            hex("0a 00 00 02 1f 90 00 00")
        );
        assert!(endpoint_data(Family::V6, &"10.0.0.2".parse().unwrap(), 8080).is_err());
    }

    #[test]
    fn large_element_lists_are_split() {
        let elements: Vec<(Key, Option<Value>)> = (0..2000u32)
            .map(|i| {
                (
                    Key::Addr(IpAddr::V6(std::net::Ipv6Addr::from(u128::from(i)))),
                    Some(Value::Verdict(Verdict::Goto(
                        format!("a-rather-long-chain-name-{i:08}").into(),
                    ))),
                )
            })
            .collect();
        let op = Op::AddElements {
            set: "m".to_string(),
            elements,
        };
        let cmds = encode_op(Family::V6, &op, &mut 0).unwrap();
        assert!(cmds.len() > 1);
        for c in &cmds {
            assert!(c.msg.buffer_len() < MAX_MESSAGE_BYTES);
        }
    }
}
