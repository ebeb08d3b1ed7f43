//! ctnetlink messages: the dump request, deletions, and decoding of dumped entries, with the
//! typed messages of `netlink-packet-netfilter`. Nothing here panics on kernel input: every
//! length is checked, undecodable entries are reported as errors and skipped by the caller.

use std::net::IpAddr;

use dataplane::conntrack::Tuple;
use dataplane::nft::ruleset::Family;
use netlink_packet_core::{
    DefaultNla, Emitable, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, Nla,
    ParseableParametrized,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol, Tuple as CtTuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};

use super::Flow;

/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW`: what a dump answers with per entry.
pub(super) const CT_NEW: u16 = 1 << 8;

pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;

/// Attribute types of `enum ctattr_type` the crate has no variant for.
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
/// `enum ctattr_filter`.
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_REPLY_FLAGS: u16 = 2;
/// `CTA_FILTER_F_CTA_PROTO_NUM` (net/netfilter/nf_internals.h, same in libnetfilter_conntrack).
const CTA_FILTER_F_CTA_PROTO_NUM: u32 = 1 << 3;
const NLA_F_NESTED: u16 = 1 << 15;
const NLA_TYPE_MASK: u16 = !(1 << 15 | 1 << 14);

pub(super) fn nfproto(family: Family) -> NetfilterProtoFamily {
    match family {
        Family::V4 => NetfilterProtoFamily::IPv4,
        Family::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn push(buf: &mut Vec<u8>, family: Family, msg: ConntrackMessage, flags: u16, seq: u32) {
    let header = NetfilterHeader::new(nfproto(family), 0, 0);
    let mut nl = NetlinkMessage::from(NetfilterMessage::new(header, msg));
    nl.header.flags = NLM_F_REQUEST | flags;
    nl.header.sequence_number = seq;
    nl.finalize();
    let start = buf.len();
    buf.resize(start + nl.buffer_len(), 0);
    nl.serialize(&mut buf[start..]);
}

/// A dump of `family`'s table; with `proto`, filtered in the kernel to that L4 protocol
/// (`CTA_FILTER`, Linux 5.8+; older kernels ignore the filter and send everything).
pub(super) fn dump_request(buf: &mut Vec<u8>, family: Family, proto: Option<u8>, seq: u32) {
    let start = buf.len();
    let Some(p) = proto else {
        push(buf, family, ConntrackMessage::Get(vec![]), NLM_F_DUMP, seq);
        return;
    };
    let tuple = ConntrackAttribute::CtaTupleOrig(vec![CtTuple::Proto(vec![ProtoTuple::Protocol(
        Protocol::from(p),
    )])]);
    push(
        buf,
        family,
        ConntrackMessage::Get(vec![tuple]),
        NLM_F_DUMP,
        seq,
    );
    // The kernel parses CTA_FILTER strictly: it must carry NLA_F_NESTED, which the crate
    // does not set on attributes it has no variant for, so it is appended here.
    let flags = [
        // Host-order u32s, unlike the rest of ctnetlink.
        DefaultNla::new(
            CTA_FILTER_ORIG_FLAGS,
            CTA_FILTER_F_CTA_PROTO_NUM.to_ne_bytes().to_vec(),
        ),
        DefaultNla::new(CTA_FILTER_REPLY_FLAGS, 0u32.to_ne_bytes().to_vec()),
    ];
    let nested_len = flags.as_slice().buffer_len();
    let attr_len = 4 + nested_len;
    buf.extend_from_slice(&(attr_len as u16).to_ne_bytes());
    buf.extend_from_slice(&(CTA_FILTER | NLA_F_NESTED).to_ne_bytes());
    let at = buf.len();
    buf.resize(at + nested_len, 0);
    flags.as_slice().emit(&mut buf[at..]);
    let msg_len = (buf.len() - start) as u32;
    buf[start..start + 4].copy_from_slice(&msg_len.to_ne_bytes());
}

/// The original tuple of `flow` as a `CTA_TUPLE_ORIG`.
fn orig_tuple(t: &Tuple) -> ConntrackAttribute {
    ConntrackAttribute::CtaTupleOrig(vec![
        CtTuple::Ip(vec![
            IPTuple::SourceAddress(t.src),
            IPTuple::DestinationAddress(t.dst),
        ]),
        CtTuple::Proto(vec![
            ProtoTuple::Protocol(Protocol::from(t.proto)),
            ProtoTuple::SourcePort(t.src_port),
            ProtoTuple::DestinationPort(t.dst_port),
        ]),
    ])
}

/// Deletes the entry `flow` was listed as: looked up by its original tuple in its zone, and
/// only if it still has the listed id (a new entry that reuses the tuple is left alone; the
/// kernel answers ENOENT). Always carries the tuple: a `CT_DELETE` without one flushes the
/// whole table.
pub(super) fn delete_request(buf: &mut Vec<u8>, flow: &Flow, ack: bool, seq: u32) {
    let mut attrs = vec![orig_tuple(&flow.orig)];
    if flow.zone != 0 {
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_ZONE,
            flow.zone.to_be_bytes().to_vec(),
        )));
    }
    if let Some(id) = flow.id {
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_ID,
            id.to_be_bytes().to_vec(),
        )));
    }
    let family = Family::of(&flow.orig.src);
    let flags = if ack { NLM_F_ACK } else { 0 };
    push(buf, family, ConntrackMessage::Delete(attrs), flags, seq);
}

/// One netlink message inside a received datagram.
pub(super) struct RawMessage<'a> {
    pub kind: u16,
    pub seq: u32,
    /// The whole message, header included.
    pub bytes: &'a [u8],
}

impl RawMessage<'_> {
    /// The errno of an `NLMSG_ERROR` (0 for an ACK) or of an `NLMSG_DONE`, as a positive
    /// number; `EPROTO` if the message is too short to carry one.
    pub fn code(&self) -> i32 {
        match self.bytes.get(NLMSG_HDRLEN..NLMSG_HDRLEN + 4) {
            Some(b) => i32::from_ne_bytes([b[0], b[1], b[2], b[3]]).wrapping_neg(),
            None if self.kind == NLMSG_DONE => 0,
            None => libc::EPROTO,
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 4)?;
    Some(u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
}

/// Splits a datagram into netlink messages.
pub(super) fn messages(datagram: &[u8]) -> Result<Vec<RawMessage<'_>>, String> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + NLMSG_HDRLEN <= datagram.len() {
        let h = &datagram[off..];
        let len = u32_at(h, 0).unwrap_or(0) as usize;
        if len < NLMSG_HDRLEN || len > h.len() {
            return Err(format!(
                "truncated netlink message ({len} bytes at offset {off} of {})",
                datagram.len()
            ));
        }
        out.push(RawMessage {
            kind: u16::from_ne_bytes([h[4], h[5]]),
            seq: u32_at(h, 8).unwrap_or(0),
            bytes: &h[..len],
        });
        // Messages are 4-byte aligned (NLMSG_ALIGN).
        off += (len + 3) & !3;
    }
    Ok(out)
}

fn decode_tuple(parts: &[CtTuple]) -> Option<Tuple> {
    let (mut src, mut dst, mut proto) = (None, None, None);
    let (mut src_port, mut dst_port) = (0, 0);
    for part in parts {
        match part {
            CtTuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            CtTuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(n) => proto = Some(u8::from(*n)),
                        ProtoTuple::SourcePort(n) => src_port = *n,
                        ProtoTuple::DestinationPort(n) => dst_port = *n,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let (src, dst): (IpAddr, IpAddr) = (src?, dst?);
    if src.is_ipv4() != dst.is_ipv4() {
        return None;
    }
    Some(Tuple {
        proto: proto?,
        src,
        dst,
        src_port,
        dst_port,
    })
}

/// The value of an attribute the crate keeps as raw bytes.
fn raw_value(nla: &DefaultNla) -> Vec<u8> {
    let mut v = vec![0; nla.value_len()];
    nla.emit_value(&mut v);
    v
}

/// Decodes one `CT_NEW` message of a dump into a flow.
pub(super) fn decode_flow(msg: &RawMessage<'_>) -> Result<Flow, String> {
    let payload = msg.bytes.get(NLMSG_HDRLEN..).unwrap_or_default();
    let parsed = NetfilterMessage::parse_with_param(payload, msg.kind)
        .map_err(|e| format!("undecodable conntrack entry: {e}"))?;
    let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) = parsed.inner else {
        return Err(format!("unexpected message type {:#x}", msg.kind));
    };
    let (mut orig, mut reply, mut zone, mut id) = (None, None, 0, None);
    for attr in &attrs {
        match attr {
            ConntrackAttribute::CtaTupleOrig(t) => orig = decode_tuple(t),
            ConntrackAttribute::CtaTupleReply(t) => reply = decode_tuple(t),
            ConntrackAttribute::Other(nla) => match (nla.kind() & NLA_TYPE_MASK, raw_value(nla)) {
                (CTA_ZONE, v) if v.len() == 2 => zone = u16::from_be_bytes([v[0], v[1]]),
                (CTA_ID, v) if v.len() == 4 => {
                    id = Some(u32::from_be_bytes([v[0], v[1], v[2], v[3]]))
                }
                _ => {}
            },
            _ => {}
        }
    }
    match (orig, reply) {
        (Some(orig), Some(reply)) => Ok(Flow {
            orig,
            reply,
            zone,
            id,
        }),
        _ => Err("conntrack entry without complete tuples".into()),
    }
}

/// What the dump reader takes from a datagram: each message's type, sequence number and code,
/// and for a `CT_NEW` its flow or why it cannot be decoded. Public (hidden) for the fuzz tests.
#[doc(hidden)]
pub fn decode_datagram(datagram: &[u8]) -> Result<Vec<DecodedMessage>, String> {
    Ok(messages(datagram)?
        .iter()
        .map(|m| {
            let flow = (m.kind == CT_NEW).then(|| decode_flow(m));
            (m.kind, m.seq, m.code(), flow)
        })
        .collect())
}

/// A message of [`decode_datagram`]: type, sequence number, code, flow of a `CT_NEW`.
pub type DecodedMessage = (u16, u32, i32, Option<Result<Flow, String>>);

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn flow(src: &str, dst: &str, reply_src: &str) -> Flow {
        Flow {
            orig: Tuple {
                proto: 17,
                src: ip(src),
                dst: ip(dst),
                src_port: 40000,
                dst_port: 53,
            },
            reply: Tuple {
                proto: 17,
                src: ip(reply_src),
                dst: ip(src),
                src_port: 5353,
                dst_port: 40000,
            },
            zone: 0,
            id: Some(0xdead_beef),
        }
    }

    /// What the kernel sends for an entry: a `CT_NEW` with both tuples, id, status, zone.
    fn entry_message(f: &Flow, zone: Option<u16>) -> Vec<u8> {
        let tuple = |t: &Tuple| {
            vec![
                CtTuple::Ip(vec![
                    IPTuple::SourceAddress(t.src),
                    IPTuple::DestinationAddress(t.dst),
                ]),
                CtTuple::Proto(vec![
                    ProtoTuple::Protocol(Protocol::from(t.proto)),
                    ProtoTuple::SourcePort(t.src_port),
                    ProtoTuple::DestinationPort(t.dst_port),
                ]),
            ]
        };
        let mut attrs = vec![
            ConntrackAttribute::CtaTupleOrig(tuple(&f.orig)),
            ConntrackAttribute::CtaTupleReply(tuple(&f.reply)),
            ConntrackAttribute::CtaTimeout(30),
            ConntrackAttribute::Other(DefaultNla::new(
                CTA_ID,
                f.id.unwrap().to_be_bytes().to_vec(),
            )),
        ];
        if let Some(z) = zone {
            attrs.push(ConntrackAttribute::Other(DefaultNla::new(
                CTA_ZONE,
                z.to_be_bytes().to_vec(),
            )));
        }
        let mut buf = Vec::new();
        push(
            &mut buf,
            Family::of(&f.orig.src),
            ConntrackMessage::New(attrs),
            0,
            7,
        );
        buf
    }

    #[test]
    fn decodes_what_the_kernel_sends() {
        for f in [
            flow("10.0.5.5", "172.30.0.10", "10.0.0.1"),
            flow("fd00:10::5", "fd00:172:30::10", "fd00:10::1"),
        ] {
            let bytes = entry_message(&f, None);
            let msgs = messages(&bytes).unwrap();
            assert_eq!(msgs.len(), 1);
            assert_eq!(msgs[0].kind, CT_NEW);
            assert_eq!(msgs[0].seq, 7);
            assert_eq!(decode_flow(&msgs[0]).unwrap(), f);
            let zoned = entry_message(&f, Some(7));
            let got = decode_flow(&messages(&zoned).unwrap()[0]).unwrap();
            assert_eq!(got.zone, 7);
        }
    }

    /// Walks the attributes of a message payload: (type, value) pairs.
    fn attrs(b: &[u8]) -> Vec<(u16, &[u8])> {
        let mut out = Vec::new();
        let mut off = 0;
        while off + 4 <= b.len() {
            let len = u16::from_ne_bytes([b[off], b[off + 1]]) as usize;
            let kind = u16::from_ne_bytes([b[off + 2], b[off + 3]]) & NLA_TYPE_MASK;
            out.push((kind, &b[off + 4..off + len]));
            off += (len + 3) & !3;
        }
        out
    }

    #[test]
    fn delete_carries_the_whole_orig_tuple_and_id() {
        let f = flow("10.0.5.5", "172.30.0.10", "10.0.0.1");
        let mut buf = Vec::new();
        delete_request(&mut buf, &f, true, 42);
        let msgs = messages(&buf).unwrap();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].kind, (1 << 8) | 2);
        let flags = u16::from_ne_bytes([buf[6], buf[7]]);
        assert_eq!(flags, NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(buf[16], libc::AF_INET as u8, "nfgen_family");
        let top = attrs(&buf[20..]);
        assert_eq!(top.iter().map(|a| a.0).collect::<Vec<_>>(), vec![1, CTA_ID]);
        assert_eq!(top[1].1, 0xdead_beefu32.to_be_bytes());
        let tuple = attrs(top[0].1);
        let ips = attrs(tuple[0].1);
        assert_eq!(
            ips,
            vec![(1, &[10, 0, 5, 5][..]), (2, &[172, 30, 0, 10][..])]
        );
        let proto = attrs(tuple[1].1);
        assert_eq!(
            proto,
            vec![
                (1, &[17][..]),
                (2, &40000u16.to_be_bytes()[..]),
                (3, &53u16.to_be_bytes()[..])
            ]
        );
        // No ACK asked: only errors come back.
        let mut buf = Vec::new();
        delete_request(&mut buf, &flow("fd00::1", "fd00::2", "fd00::3"), false, 43);
        assert_eq!(u16::from_ne_bytes([buf[6], buf[7]]), NLM_F_REQUEST);
        assert_eq!(buf[16], libc::AF_INET6 as u8);
    }

    #[test]
    fn dump_request_filters_on_the_protocol() {
        let mut buf = Vec::new();
        dump_request(&mut buf, Family::V6, Some(17), 9);
        assert_eq!(u16::from_ne_bytes([buf[4], buf[5]]), (1 << 8) | 1);
        assert_eq!(buf[16], libc::AF_INET6 as u8);
        let top = attrs(&buf[20..]);
        assert_eq!(
            top.iter().map(|a| a.0).collect::<Vec<_>>(),
            vec![1, CTA_FILTER]
        );
        let filter = attrs(top[1].1);
        assert_eq!(filter[0], (1, &8u32.to_ne_bytes()[..]));
        let mut plain = Vec::new();
        dump_request(&mut plain, Family::V4, None, 9);
        assert_eq!(plain.len(), 20, "header and nfgenmsg only");
    }

    /// Truncated, bit-flipped and random input: errors, never a panic.
    #[test]
    fn garbage_never_panics() {
        let good = entry_message(
            &flow("fd00:10::5", "fd00:172:30::10", "fd00:10::1"),
            Some(3),
        );
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rand = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let try_all = |bytes: &[u8]| {
            if let Ok(msgs) = messages(bytes) {
                for m in &msgs {
                    let _ = decode_flow(m);
                    let _ = m.code();
                }
            }
        };
        for cut in 0..good.len() {
            try_all(&good[..cut]);
            // Keep the header's length consistent with the cut, so the payload is parsed.
            let mut fixed = good[..cut].to_vec();
            if cut >= 16 {
                fixed[..4].copy_from_slice(&(cut as u32).to_ne_bytes());
            }
            try_all(&fixed);
        }
        for _ in 0..20_000 {
            let mut b = good.clone();
            for _ in 0..(rand() % 4 + 1) {
                let i = (rand() as usize) % b.len();
                b[i] = rand() as u8;
            }
            let len = b.len() as u32;
            b[..4].copy_from_slice(&len.to_ne_bytes());
            try_all(&b);
        }
        for _ in 0..2_000 {
            let len = (rand() % 200) as usize;
            let mut b: Vec<u8> = (0..len).map(|_| rand() as u8).collect();
            if len >= 16 {
                b[..4].copy_from_slice(&(len as u32).to_ne_bytes());
                b[4..6].copy_from_slice(&CT_NEW.to_ne_bytes());
            }
            try_all(&b);
        }
    }
}
