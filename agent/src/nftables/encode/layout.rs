//! Layouts and encodings shared by the message builders and the decoder: families, hooks, set
//! key and data types, the `typeof` user data nft reads back, keys, verdicts and attributes.

use super::*;

pub(in crate::nftables) fn nfproto(family: Family) -> NetfilterProtoFamily {
    match family {
        Family::V4 => NetfilterProtoFamily::IPv4,
        Family::V6 => NetfilterProtoFamily::IPv6,
    }
}

/// Offsets of the source and destination address in the network header, and their length.
pub(in crate::nftables) fn addr_layout(family: Family) -> (u32, u32, u32) {
    match family {
        Family::V4 => (12, 16, 4),
        Family::V6 => (8, 24, 16),
    }
}

pub(in crate::nftables) fn hook_number(hook: Hook) -> InetHookNumber {
    match hook {
        Hook::Prerouting => InetHookNumber::PreRouting,
        Hook::Input => InetHookNumber::LocalIn,
        Hook::Forward => InetHookNumber::Forward,
        Hook::Output => InetHookNumber::LocalOut,
        Hook::Postrouting => InetHookNumber::PostRouting,
    }
}

pub(in crate::nftables) fn chain_type_name(t: ChainType) -> &'static str {
    match t {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    }
}

pub(in crate::nftables) fn addr_type(family: Family) -> (u32, u32) {
    match family {
        Family::V4 => (TYPE_IPV4_ADDR, 4),
        Family::V6 => (TYPE_IPV6_ADDR, 16),
    }
}

pub(super) fn concat(types: &[u32]) -> u32 {
    types.iter().fold(0, |acc, t| (acc << CONCAT_TYPE_BITS) | t)
}

/// `NFTA_SET_KEY_TYPE` and `NFTA_SET_KEY_LEN` of a key type. Concatenated fields are each padded
/// to 4 bytes, the width of the 32-bit registers they are loaded into.
pub(in crate::nftables) fn key_layout(family: Family, key: KeyType) -> (u32, u32) {
    let (addr_type, addr_len) = addr_type(family);
    match key {
        KeyType::Addr => (addr_type, addr_len),
        KeyType::AddrProtoPort | KeyType::AddrProtoPortToAddr | KeyType::AddrProtoPortToPort => (
            concat(&[addr_type, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            addr_len + 8,
        ),
        KeyType::AddrProto => (concat(&[addr_type, TYPE_INET_PROTO]), addr_len + 4),
        KeyType::ProtoPort | KeyType::ProtoPortToAddr | KeyType::ProtoPortToPort => {
            (concat(&[TYPE_INET_PROTO, TYPE_INET_SERVICE]), 8)
        }
        KeyType::AddrPair => (concat(&[addr_type, addr_type]), 2 * addr_len),
        // A `numgen` value, big-endian in the map (the rule converts it with `byteorder`).
        KeyType::Interval => (TYPE_INTEGER, 4),
        // The index is the `numgen` value as the rule computes it: host-endian.
        KeyType::AddrProtoPortIndex => (
            concat(&[addr_type, TYPE_INET_PROTO, TYPE_INET_SERVICE, TYPE_INTEGER]),
            addr_len + 12,
        ),
        KeyType::ProtoPortIndex => (
            concat(&[TYPE_INET_PROTO, TYPE_INET_SERVICE, TYPE_INTEGER]),
            12,
        ),
        KeyType::AddrProtoIndex => (
            concat(&[addr_type, TYPE_INET_PROTO, TYPE_INTEGER]),
            addr_len + 8,
        ),
        KeyType::AffinityClients => (
            concat(&[addr_type, addr_type, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            2 * addr_len + 8,
        ),
    }
}

/// `NFTA_SET_DATA_TYPE` and `NFTA_SET_DATA_LEN` of maps to endpoints (endpoint maps and
/// endpoint lists): `ADDR . inet_service`, the port padded to 4 bytes.
pub(in crate::nftables) fn endpoint_data_layout(family: Family) -> (u32, u32) {
    let (addr_type, addr_len) = addr_type(family);
    (concat(&[addr_type, TYPE_INET_SERVICE]), addr_len + 4)
}

/// An endpoint as map data (of an endpoint-list entry or an endpoint-map interval start): the
/// address, then the port (big-endian) padded to 4 bytes, as `nat` reads them from consecutive
/// registers.
pub(in crate::nftables) fn endpoint_data(
    family: Family,
    addr: &IpAddr,
    port: u16,
) -> Result<ElementBytes, String> {
    check_family(family, addr)?;
    let mut out = ElementBytes::new();
    push_addr(&mut out, addr);
    out.extend_from_slice(&port.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    Ok(out)
}

/// `NFTA_PAYLOAD_*` of a payload write (the typed crate has the load attributes only).
pub(in crate::nftables) const NFTA_PAYLOAD_BASE: u16 = 2;
pub(in crate::nftables) const NFTA_PAYLOAD_OFFSET: u16 = 3;
pub(in crate::nftables) const NFTA_PAYLOAD_LEN: u16 = 4;
pub(in crate::nftables) const NFTA_PAYLOAD_SREG: u16 = 5;
pub(in crate::nftables) const NFTA_PAYLOAD_CSUM_TYPE: u16 = 6;
pub(in crate::nftables) const NFTA_PAYLOAD_CSUM_OFFSET: u16 = 7;
pub(in crate::nftables) const NFTA_PAYLOAD_CSUM_FLAGS: u16 = 8;
pub(in crate::nftables) const NFT_PAYLOAD_CSUM_NONE: u32 = 0;
pub(in crate::nftables) const NFT_PAYLOAD_CSUM_INET: u32 = 1;
pub(in crate::nftables) const NFT_PAYLOAD_L4CSUM_PSEUDOHDR: u32 = 1;
/// Where the checksum is in a TCP header.
pub(in crate::nftables) const TCP_CHECKSUM_OFFSET: u32 = 16;

/// A payload write as nft writes it: the field, and how the kernel fixes the checksums
/// around it. Encoding sends it; decoding takes back only a write that equals one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::nftables) struct PayloadWrite {
    pub base: u32,
    pub offset: u32,
    pub len: u32,
    pub csum_type: u32,
    pub csum_offset: u32,
    pub csum_flags: u32,
}

impl PayloadWrite {
    /// `ip daddr set …`: the IPv4 header checksum (`csum_type inet` at offset 10) and, in both
    /// families, the transport checksum over the pseudo-header (TCP; UDP unless it is 0).
    pub fn daddr(family: Family) -> PayloadWrite {
        let (_, daddr_off, alen) = addr_layout(family);
        let (csum_type, csum_offset) = match family {
            Family::V4 => (NFT_PAYLOAD_CSUM_INET, 10),
            Family::V6 => (NFT_PAYLOAD_CSUM_NONE, 0),
        };
        PayloadWrite {
            base: NFT_PAYLOAD_NETWORK_HEADER,
            offset: daddr_off,
            len: alen,
            csum_type,
            csum_offset,
            csum_flags: NFT_PAYLOAD_L4CSUM_PSEUDOHDR,
        }
    }

    /// `tcp dport set …`: the TCP checksum.
    pub fn tcp_dport() -> PayloadWrite {
        PayloadWrite {
            base: NFT_PAYLOAD_TRANSPORT_HEADER,
            offset: 2,
            len: 2,
            csum_type: NFT_PAYLOAD_CSUM_INET,
            csum_offset: TCP_CHECKSUM_OFFSET,
            csum_flags: 0,
        }
    }

    /// The `payload` expression's attributes, writing from `sreg`.
    pub fn attrs(self, sreg: Register) -> Vec<DefaultNla> {
        vec![
            u32_attr(NFTA_PAYLOAD_SREG, sreg.into()),
            u32_attr(NFTA_PAYLOAD_BASE, self.base),
            u32_attr(NFTA_PAYLOAD_OFFSET, self.offset),
            u32_attr(NFTA_PAYLOAD_LEN, self.len),
            u32_attr(NFTA_PAYLOAD_CSUM_TYPE, self.csum_type),
            u32_attr(NFTA_PAYLOAD_CSUM_OFFSET, self.csum_offset),
            u32_attr(NFTA_PAYLOAD_CSUM_FLAGS, self.csum_flags),
        ]
    }
}

/// `NFTA_SET_DATA_TYPE` and `NFTA_SET_DATA_LEN` of the maps to addresses and to ports; `None`
/// for other sets.
pub(in crate::nftables) fn value_data_layout(family: Family, key: KeyType) -> Option<(u32, u32)> {
    match key {
        KeyType::AddrProtoPortToAddr | KeyType::ProtoPortToAddr | KeyType::AddrProtoIndex => {
            Some(addr_type(family))
        }
        KeyType::ProtoPortToPort | KeyType::AddrProtoPortToPort => Some((TYPE_INET_SERVICE, 2)),
        _ => None,
    }
}

/// A port as map data (big-endian).
pub(in crate::nftables) fn port_data(port: u16) -> ElementBytes {
    let mut out = ElementBytes::new();
    out.extend_from_slice(&port.to_be_bytes());
    out
}

/// An address as map data.
pub(in crate::nftables) fn addr_data(
    family: Family,
    addr: &IpAddr,
) -> Result<ElementBytes, String> {
    check_family(family, addr)?;
    let mut out = ElementBytes::new();
    push_addr(&mut out, addr);
    Ok(out)
}

/// An element's key or data: at most 32 bytes (two IPv6 addresses), built in place, as
/// encoding writes one of each per element.
#[derive(Clone, Copy)]
pub(in crate::nftables) struct ElementBytes {
    buf: [u8; 32],
    len: usize,
}

impl ElementBytes {
    fn new() -> ElementBytes {
        ElementBytes {
            buf: [0; 32],
            len: 0,
        }
    }

    /// Appends `bytes`; every key and data layout fits (the longest is two IPv6 addresses).
    fn extend_from_slice(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        self.buf[self.len..end].copy_from_slice(bytes);
        self.len = end;
    }
}

impl std::ops::Deref for ElementBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

fn push_addr(out: &mut ElementBytes, addr: &IpAddr) {
    match addr {
        IpAddr::V4(a) => out.extend_from_slice(&a.octets()),
        IpAddr::V6(a) => out.extend_from_slice(&a.octets()),
    }
}

/// One libnftnl user-data TLV.
pub(super) fn tlv(out: &mut Vec<u8>, kind: u8, value: &[u8]) {
    out.push(kind);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

/// A TLV holding a host-endian u32, as `nftnl_udata_put_u32` writes it.
pub(super) fn tlv_u32(out: &mut Vec<u8>, kind: u8, value: u32) {
    tlv(out, kind, &value.to_ne_bytes());
}

/// nft's `typeof` description of one expression: its kind, then its own TLVs.
pub(super) fn typeof_expr(kind: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_TYPEOF_EXPR, kind);
    tlv(&mut out, UDATA_TYPEOF_DATA, data);
    out
}

pub(super) fn typeof_numgen(modulus: u32) -> Vec<u8> {
    let mut numgen = Vec::new();
    tlv_u32(&mut numgen, 0, NFT_NG_RANDOM); // NFTNL_UDATA_NUMGEN_TYPE
    tlv_u32(&mut numgen, 1, modulus); // NFTNL_UDATA_NUMGEN_MODULUS
    tlv_u32(&mut numgen, 2, 0); // NFTNL_UDATA_NUMGEN_OFFSET
    typeof_expr(EXPR_NUMGEN, &numgen)
}

pub(super) fn typeof_daddr(family: Family) -> Vec<u8> {
    match family {
        Family::V4 => typeof_payload(PROTO_DESC_IP, IPHDR_DADDR),
        Family::V6 => typeof_payload(PROTO_DESC_IP6, IP6HDR_DADDR),
    }
}

pub(super) fn typeof_saddr(family: Family) -> Vec<u8> {
    match family {
        Family::V4 => typeof_payload(PROTO_DESC_IP, IPHDR_SADDR),
        Family::V6 => typeof_payload(PROTO_DESC_IP6, IP6HDR_SADDR),
    }
}

fn typeof_l4proto() -> Vec<u8> {
    let mut l4proto = Vec::new();
    tlv_u32(&mut l4proto, 0, MetaKey::L4Proto.into()); // NFTNL_UDATA_META_KEY
    typeof_expr(EXPR_META, &l4proto)
}

/// A concatenation; its members are TLVs numbered from 0.
pub(super) fn typeof_concat(members: &[Vec<u8>]) -> Vec<u8> {
    let mut data = Vec::new();
    for (i, m) in (0u8..).zip(members) {
        tlv(&mut data, i, m);
    }
    typeof_expr(EXPR_CONCAT, &data)
}

/// The `typeof` of an endpoint map's data: `ip daddr . th dport`.
pub(super) fn typeof_endpoint(family: Family) -> Vec<u8> {
    typeof_concat(&[
        typeof_daddr(family),
        typeof_payload(PROTO_DESC_TH, THDR_DPORT),
    ])
}

/// The set user data nft 1.0.6 writes for an endpoint-list map, `typeof [ip daddr .] meta
/// l4proto . th dport . numgen random mod 2 : ip daddr . th dport`.
pub(super) fn list_udata(family: Family, nodeport: bool) -> Vec<u8> {
    let mut key = Vec::new();
    if !nodeport {
        key.push(typeof_daddr(family));
    }
    key.push(typeof_l4proto());
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

/// The set user data of the session-affinity map, `typeof ip saddr . ip daddr . meta l4proto .
/// th dport : ip daddr . th dport`.
pub(super) fn affinity_udata(family: Family) -> Vec<u8> {
    let key = [
        typeof_saddr(family),
        typeof_daddr(family),
        typeof_l4proto(),
        typeof_payload(PROTO_DESC_TH, THDR_DPORT),
    ];
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_SET_KEYBYTEORDER, BYTEORDER_INVALID);
    tlv_u32(&mut out, UDATA_SET_DATABYTEORDER, BYTEORDER_INVALID);
    tlv(&mut out, UDATA_SET_KEY_TYPEOF, &typeof_concat(&key));
    tlv(&mut out, UDATA_SET_DATA_TYPEOF, &typeof_endpoint(family));
    out
}

/// The user data of `decl`, its comment aside. The older key types carry what makes `nft
/// list` print them as rendered: the key byte order of address sets (without it nft still
/// prints them), the `typeof` of the maps declared so (without it nft cannot print them).
/// Those of the shared address lists carry every byte nft 1.0.6 writes, so that a set reads
/// the same whichever of nft and nftproxy wrote it.
pub(super) fn set_udata(family: Family, decl: &SetDecl) -> Vec<u8> {
    match decl.key {
        KeyType::Addr => {
            let mut u = Vec::new();
            tlv_u32(&mut u, UDATA_SET_KEYBYTEORDER, BYTEORDER_BIG_ENDIAN);
            u
        }
        KeyType::Interval => interval_map_udata(family),
        KeyType::AddrProtoPortIndex => list_udata(family, false),
        KeyType::ProtoPortIndex => list_udata(family, true),
        KeyType::AffinityClients => affinity_udata(family),
        KeyType::AddrProtoIndex => shared_list_udata(family),
        // A verdict's byte order is nft's "invalid" one.
        KeyType::AddrProto => concat_type_udata(decl.is_vmap.then_some(BYTEORDER_INVALID)),
        KeyType::AddrProtoPortToPort => concat_type_udata(Some(BYTEORDER_BIG_ENDIAN)),
        _ => Vec::new(),
    }
}

/// The set user data nft 1.0.6 writes for a concatenation declared with `type`: no key byte
/// order, a `typeof` concatenation of nothing, and for a map its data's byte order
/// (`data_byteorder`) and "data is not an interval".
pub(super) fn concat_type_udata(data_byteorder: Option<u32>) -> Vec<u8> {
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_SET_KEYBYTEORDER, BYTEORDER_INVALID);
    if let Some(order) = data_byteorder {
        tlv_u32(&mut out, UDATA_SET_DATABYTEORDER, order);
    }
    tlv(&mut out, UDATA_SET_KEY_TYPEOF, &typeof_concat(&[]));
    if data_byteorder.is_some() {
        tlv_u32(&mut out, UDATA_SET_DATA_INTERVAL, 0);
    }
    out
}

/// The set user data nft 1.0.6 writes for a shared address list, `typeof ip daddr . meta
/// l4proto . numgen random mod 2 : ip daddr` (the data, one address, is big-endian).
pub(super) fn shared_list_udata(family: Family) -> Vec<u8> {
    let key = [typeof_daddr(family), typeof_l4proto(), typeof_numgen(2)];
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_SET_KEYBYTEORDER, BYTEORDER_INVALID);
    tlv_u32(&mut out, UDATA_SET_DATABYTEORDER, BYTEORDER_BIG_ENDIAN);
    tlv(&mut out, UDATA_SET_KEY_TYPEOF, &typeof_concat(&key));
    tlv(&mut out, UDATA_SET_DATA_TYPEOF, &typeof_daddr(family));
    tlv_u32(&mut out, UDATA_SET_DATA_INTERVAL, 0);
    out
}

pub(super) fn typeof_payload(desc: u32, field: u32) -> Vec<u8> {
    let mut data = Vec::new();
    tlv_u32(&mut data, 0, desc);
    tlv_u32(&mut data, 1, field);
    typeof_expr(EXPR_PAYLOAD, &data)
}

/// The set user data nft 1.0.6 writes for `typeof numgen random mod 2 : ip daddr . th dport`,
/// `flags interval` (100 bytes for both families): the key and data byte orders, the two
/// `typeof` expressions, and "data is not an interval". `nft list` prints the map from it.
pub(super) fn interval_map_udata(family: Family) -> Vec<u8> {
    let mut out = Vec::new();
    tlv_u32(&mut out, UDATA_SET_KEYBYTEORDER, BYTEORDER_HOST_ENDIAN);
    tlv_u32(&mut out, UDATA_SET_DATABYTEORDER, BYTEORDER_INVALID);
    tlv(&mut out, UDATA_SET_KEY_TYPEOF, &typeof_numgen(2));
    tlv(&mut out, UDATA_SET_DATA_TYPEOF, &typeof_endpoint(family));
    tlv_u32(&mut out, UDATA_SET_DATA_INTERVAL, 0);
    out
}

pub(super) fn addr_bytes(addr: &IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

pub(super) fn check_family(family: Family, addr: &IpAddr) -> Result<(), String> {
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
pub(in crate::nftables) fn key_bytes(family: Family, key: &Key) -> Result<ElementBytes, String> {
    let proto_port = |out: &mut ElementBytes, proto: dataplane::nft::ruleset::Proto, port: u16| {
        out.extend_from_slice(&[proto.number(), 0, 0, 0]);
        out.extend_from_slice(&port.to_be_bytes());
        out.extend_from_slice(&[0, 0]);
    };
    let mut out = ElementBytes::new();
    match key {
        Key::Addr(a) => {
            check_family(family, a)?;
            push_addr(&mut out, a);
        }
        Key::AddrProtoPort(a, proto, port) => {
            check_family(family, a)?;
            push_addr(&mut out, a);
            proto_port(&mut out, *proto, *port);
        }
        Key::ProtoPort(proto, port) => proto_port(&mut out, *proto, *port),
        Key::AddrPair(a) => {
            check_family(family, a)?;
            push_addr(&mut out, a);
            push_addr(&mut out, a);
        }
        Key::Interval { at, .. } => out.extend_from_slice(&at.to_be_bytes()),
        Key::AddrProtoPortIndex(a, proto, port, i) => {
            check_family(family, a)?;
            push_addr(&mut out, a);
            proto_port(&mut out, *proto, *port);
            out.extend_from_slice(&u32::from(*i).to_ne_bytes());
        }
        Key::ProtoPortIndex(proto, port, i) => {
            proto_port(&mut out, *proto, *port);
            out.extend_from_slice(&u32::from(*i).to_ne_bytes());
        }
        Key::AddrProto(a, proto) => {
            check_family(family, a)?;
            push_addr(&mut out, a);
            out.extend_from_slice(&[proto.number(), 0, 0, 0]);
        }
        Key::AddrProtoIndex(a, proto, i) => {
            check_family(family, a)?;
            push_addr(&mut out, a);
            out.extend_from_slice(&[proto.number(), 0, 0, 0]);
            out.extend_from_slice(&u32::from(*i).to_ne_bytes());
        }
    }
    Ok(out)
}

/// The key of a session-affinity entry: client, destination, protocol and port.
pub(in crate::nftables) fn affinity_key_bytes(
    e: &dataplane::nft::build::affinity::Entry,
) -> Vec<u8> {
    let mut out = addr_bytes(&e.client);
    out.extend(addr_bytes(&e.dest));
    out.extend_from_slice(&[e.proto.number(), 0, 0, 0]);
    out.extend_from_slice(&e.port.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    out
}

pub(in crate::nftables) fn verdict_attrs(v: &Verdict) -> Vec<VerdictAttribute> {
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
pub(super) fn udata_string(kind: u8, text: &str) -> Result<Vec<u8>, String> {
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

pub(super) fn u32_attr(kind: u16, value: u32) -> DefaultNla {
    DefaultNla::new(kind, value.to_be_bytes().to_vec())
}

pub(super) fn str_attr(kind: u16, value: &str) -> DefaultNla {
    let mut bytes = Vec::with_capacity(value.len() + 1);
    bytes.extend_from_slice(value.as_bytes());
    bytes.push(0);
    DefaultNla::new(kind, bytes)
}
