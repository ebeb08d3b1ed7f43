//! Rules to nf_tables expressions: one list of expressions per match and per action.

use super::*;

pub(super) type Expr = ListAttribute<ExpressionAttribute>;

pub(super) fn other(name: &str, attributes: Vec<DefaultNla>) -> Expr {
    Expressions::Other {
        expression_type: name.to_string(),
        attributes,
    }
    .into()
}

pub(super) fn payload(base: u32, offset: u32, len: u32, dreg: Register) -> Expr {
    Expressions::Payload(vec![
        Payload::DestinationRegister(dreg),
        Payload::Base(base),
        Payload::Offset(offset),
        Payload::Len(len),
    ])
    .into()
}

pub(super) fn cmp(op: Operator, data: Vec<u8>) -> Expr {
    Expressions::Cmp(vec![
        Cmp::SourceRegister(Register::Reg1),
        Cmp::Op(op),
        Cmp::Data(DataAttribute::Value(data)),
    ])
    .into()
}

pub(super) fn bitwise(mask: Vec<u8>, xor: Vec<u8>) -> Expr {
    Expressions::Bitwise(vec![
        Bitwise::SourceRegister(Register::Reg1),
        Bitwise::DestinationRegister(Register::Reg1),
        Bitwise::Length(mask.len() as u32),
        Bitwise::Mask(DataAttribute::Value(mask)),
        Bitwise::Xor(DataAttribute::Value(xor)),
    ])
    .into()
}

pub(super) fn meta_load(key: MetaKey, dreg: Register) -> Expr {
    Expressions::Meta(vec![Meta::Key(key), Meta::DestinationRegister(dreg)]).into()
}

pub(super) fn immediate(dreg: Register, data: DataAttribute) -> Expr {
    Expressions::Immediate(vec![
        Immediate::DestinationRegister(dreg),
        Immediate::Data(data),
    ])
    .into()
}

pub(super) fn lookup(set: &str, sreg: Register, dreg: Option<Register>) -> Expr {
    let mut attrs = vec![Lookup::Set(set.to_string()), Lookup::SourceRegister(sreg)];
    if let Some(dreg) = dreg {
        attrs.push(Lookup::DestinationRegister(dreg));
    }
    Expressions::Lookup(attrs).into()
}

pub(super) fn op_of(negate: bool) -> Operator {
    if negate {
        Operator::NotEqual
    } else {
        Operator::Equal
    }
}

/// `ip daddr [!=] NET`: an exact compare for a host, a masked compare for a prefix.
pub(super) fn addr_match(
    family: Family,
    net: &IpNet,
    dest: bool,
    negate: bool,
    out: &mut Vec<Expr>,
) {
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

pub(super) const IFNAMSIZ: usize = 16;

pub(super) fn match_exprs(family: Family, m: &Match, out: &mut Vec<Expr>) -> Result<(), String> {
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
        Match::AddrProtoInSet { set } => {
            addr_proto_load(family, out);
            out.push(lookup(set, Register::Reg1, None));
        }
        Match::CtOriginalAddrProtoPortInSet { set } => {
            ct_original_dest(family, 0, out);
            out.push(lookup(set, Register::Reg1, None));
        }
        Match::CtOriginalProtoPortInSet { set } => {
            out.push(meta_load(MetaKey::L4Proto, nft_reg(0)));
            out.push(ct_original(NFT_CT_PROTO_DST, nft_reg(1)));
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

/// `ip saddr` into the words from 0 on.
pub(super) fn saddr_load(family: Family) -> Expr {
    let (saddr_off, _, alen) = addr_layout(family);
    payload(NFT_PAYLOAD_NETWORK_HEADER, saddr_off, alen, Register::Reg1)
}

/// `ct original KEY` into `dreg`.
pub(super) fn ct_original(key: u32, dreg: Register) -> Expr {
    other(
        "ct",
        vec![
            u32_attr(NFTA_CT_DREG, dreg.into()),
            u32_attr(NFTA_CT_KEY, key),
            DefaultNla::new(NFTA_CT_DIRECTION, vec![IP_CT_DIR_ORIGINAL]),
        ],
    )
}

/// Loads `ct original ip daddr . meta l4proto . ct original proto-dst` from word `word` on.
pub(super) fn ct_original_dest(family: Family, word: u32, out: &mut Vec<Expr>) {
    let (key, alen) = match family {
        Family::V4 => (NFT_CT_DST_IP, 4),
        Family::V6 => (NFT_CT_DST_IP6, 16),
    };
    out.push(ct_original(key, nft_reg(word)));
    out.push(meta_load(MetaKey::L4Proto, nft_reg(word + alen / 4)));
    out.push(ct_original(NFT_CT_PROTO_DST, nft_reg(word + alen / 4 + 1)));
}

/// `numgen random mod modulus [offset offset]` into `dreg`.
pub(super) fn numgen(dreg: Register, modulus: u32, offset: Option<u32>) -> Expr {
    let mut attrs = vec![
        u32_attr(NFTA_NG_DREG, dreg.into()),
        u32_attr(NFTA_NG_MODULUS, modulus),
        u32_attr(NFTA_NG_TYPE, NFT_NG_RANDOM),
    ];
    attrs.extend(offset.map(|o| u32_attr(NFTA_NG_OFFSET, o)));
    other("numgen", attrs)
}

/// `nat dnat` to the address in reg 1 and the port in `proto_reg`, with nft's flags if any.
pub(super) fn dnat(family: Family, proto_reg: Register, flags: Option<u32>) -> Expr {
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
pub(super) fn reg32(n: u32) -> Register {
    Register::from(8 + n)
}

/// The register nft names for 32-bit word `n`: the 16-byte register holding it when the word
/// starts one (`reg 1` for word 0), else the 32-bit register.
pub(super) fn nft_reg(n: u32) -> Register {
    if n.is_multiple_of(4) {
        Register::from(1 + n / 4)
    } else {
        reg32(n)
    }
}

/// Loads `meta l4proto . th dport` into the words from `word` on.
pub(super) fn proto_port_load(word: u32, out: &mut Vec<Expr>) {
    out.push(meta_load(MetaKey::L4Proto, nft_reg(word)));
    out.push(payload(
        NFT_PAYLOAD_TRANSPORT_HEADER,
        2,
        2,
        nft_reg(word + 1),
    ));
}

/// Loads `ip daddr . meta l4proto . th dport` from word 0 on; returns the next free word.
pub(super) fn addr_proto_port(family: Family, out: &mut Vec<Expr>) -> u32 {
    addr_proto_port_at(family, 0, out)
}

/// Loads `ip daddr . meta l4proto . th dport` from word `word` on; returns the next free word.
pub(super) fn addr_proto_port_at(family: Family, word: u32, out: &mut Vec<Expr>) -> u32 {
    let (_, daddr_off, alen) = addr_layout(family);
    out.push(payload(
        NFT_PAYLOAD_NETWORK_HEADER,
        daddr_off,
        alen,
        nft_reg(word),
    ));
    proto_port_load(word + alen / 4, out);
    word + alen / 4 + 2
}

/// Loads `ip daddr . meta l4proto` from word 0 on; returns the next free word.
pub(super) fn addr_proto_load(family: Family, out: &mut Vec<Expr>) -> u32 {
    let (_, daddr_off, alen) = addr_layout(family);
    out.push(payload(
        NFT_PAYLOAD_NETWORK_HEADER,
        daddr_off,
        alen,
        Register::Reg1,
    ));
    out.push(meta_load(MetaKey::L4Proto, nft_reg(alen / 4)));
    alen / 4 + 1
}

/// Where [`Action::DnatShared`] loads the key of its port lookup, as nft does: from the
/// 16-byte register after the one the address lookup writes, in both families.
pub(in crate::nftables) const SHARED_PORT_KEY_WORD: u32 = 4;

/// Looks the key loaded from word 0 up in `map` and writes the result into the packet.
fn rewrite(map: &str, write: PayloadWrite, out: &mut Vec<Expr>) {
    out.push(lookup(map, Register::Reg1, Some(Register::Reg1)));
    out.push(other("payload", write.attrs(Register::Reg1)));
}

pub(super) fn action_exprs(
    family: Family,
    action: &Action,
    out: &mut Vec<Expr>,
) -> Result<(), String> {
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
        Action::DnatRegion { map, offset } => {
            if offset.checked_add(REGION_MODULUS - 1).is_none() {
                return Err(format!("numgen offset {offset} overflows"));
            }
            out.push(numgen(Register::Reg1, REGION_MODULUS, Some(*offset)));
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
            // The endpoint (address . port) lands in the words from 0 on, as in DnatRegion.
            out.push(lookup(map, Register::Reg1, Some(Register::Reg1)));
            out.push(dnat(family, nft_reg(alen / 4), None));
        }
        Action::DnatShared {
            addresses,
            ports,
            modulus,
        } => {
            if *modulus == 0 {
                return Err("numgen modulus 0".to_string());
            }
            // The offset, 0, and the flags are sent because nft sends them: it flags a port
            // given on its own, not within an endpoint's concatenated data.
            let word = addr_proto_load(family, out);
            out.push(numgen(nft_reg(word), *modulus, Some(0)));
            out.push(lookup(addresses, Register::Reg1, Some(Register::Reg1)));
            let port = nft_reg(SHARED_PORT_KEY_WORD);
            addr_proto_port_at(family, SHARED_PORT_KEY_WORD, out);
            out.push(lookup(ports, port, Some(port)));
            out.push(dnat(family, port, Some(NF_NAT_RANGE_PROTO_SPECIFIED)));
        }
        Action::SetDaddr { map, nodeport } => {
            if *nodeport {
                proto_port_load(0, out);
            } else {
                addr_proto_port(family, out);
            }
            rewrite(map, PayloadWrite::daddr(family), out);
        }
        Action::SetDport { map } => {
            proto_port_load(0, out);
            rewrite(map, PayloadWrite::tcp_dport(), out);
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
        Action::DnatAffinity { map } => {
            // ip saddr . ip daddr . meta l4proto . th dport, then the endpoint from word 0 on.
            let words = alen / 4;
            out.push(saddr_load(family));
            addr_proto_port_at(family, words, out);
            out.push(lookup(map, Register::Reg1, Some(Register::Reg1)));
            out.push(dnat(family, nft_reg(words), None));
        }
        Action::UpdateAffinity { map, timeout_secs } => {
            // Key: ip saddr . ct original ip daddr . meta l4proto . ct original proto-dst;
            // data: ip daddr . th dport, in the words after the key (as nft places them).
            let words = alen / 4;
            out.push(saddr_load(family));
            ct_original_dest(family, words, out);
            let data = 2 * words + 2;
            out.push(payload(
                NFT_PAYLOAD_NETWORK_HEADER,
                daddr_off,
                alen,
                nft_reg(data),
            ));
            out.push(payload(
                NFT_PAYLOAD_TRANSPORT_HEADER,
                2,
                2,
                nft_reg(data + words),
            ));
            let timeout_ms = u64::from(*timeout_secs) * 1000;
            out.push(other(
                "dynset",
                vec![
                    str_attr(NFTA_DYNSET_SET_NAME, map),
                    u32_attr(NFTA_DYNSET_OP, NFT_DYNSET_OP_UPDATE),
                    u32_attr(NFTA_DYNSET_SREG_KEY, Register::Reg1.into()),
                    u32_attr(NFTA_DYNSET_SREG_DATA, nft_reg(data).into()),
                    DefaultNla::new(NFTA_DYNSET_TIMEOUT, timeout_ms.to_be_bytes().to_vec()),
                ],
            ));
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
pub(in crate::nftables) fn rule_exprs(family: Family, rule: &Rule) -> Result<Vec<Expr>, String> {
    let mut out = Vec::with_capacity(rule.matches.len() * 3 + 4);
    for m in &rule.matches {
        match_exprs(family, m, &mut out)?;
    }
    action_exprs(family, &rule.action, &mut out)?;
    Ok(out)
}
