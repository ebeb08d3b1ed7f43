//! Renders the ruleset model as nft text, in the form `nft list` prints and `nft -f` reads.

use std::fmt::Write;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::nft::ruleset::{
    Action, BaseChain, ChainType, Family, Key, KeyType, Match, REGION_MODULUS, Rule, SetDecl,
    TABLE, TABLE_COMMENT, Table, Value, Verdict,
};
use crate::nft::transaction::{Op, Transaction};

fn addr_keyword(family: Family) -> &'static str {
    family.nft_name()
}

fn net_text(net: &IpNet) -> String {
    if net.prefix_len() == net.max_prefix_len() {
        net.addr().to_string()
    } else {
        net.trunc().to_string()
    }
}

/// One rule as nft prints it inside a chain of a `family` table.
pub fn rule_text_in(family: Family, rule: &Rule) -> String {
    let fam = addr_keyword(family);
    let mut parts: Vec<String> = Vec::new();
    for m in &rule.matches {
        parts.push(match m {
            Match::CtStateNew => "ct state new".to_string(),
            Match::Daddr { net, negate } => {
                let f = Family::of_net(net).nft_name();
                let op = if *negate { "!= " } else { "" };
                format!("{f} daddr {op}{}", net_text(net))
            }
            Match::Saddr { net, negate } => {
                let f = Family::of_net(net).nft_name();
                let op = if *negate { "!= " } else { "" };
                format!("{f} saddr {op}{}", net_text(net))
            }
            Match::DaddrInSet { set } => format!("{fam} daddr @{set}"),
            Match::SaddrInSet { set } => format!("{fam} saddr @{set}"),
            Match::SaddrDaddrInSet { set } => format!("{fam} saddr . {fam} daddr @{set}"),
            Match::CtStatusDnat => "ct status dnat".to_string(),
            Match::FibSaddrLocal => "fib saddr type local".to_string(),
            Match::FibDaddrLocal => "fib daddr type local".to_string(),
            Match::L4Proto(p) => format!("meta l4proto {p}"),
            Match::AddrProtoPortInSet { set } => {
                format!("{fam} daddr . meta l4proto . th dport @{set}")
            }
            Match::ProtoPortInSet { set } => format!("meta l4proto . th dport @{set}"),
            Match::AddrProtoInSet { set } => format!("{fam} daddr . meta l4proto @{set}"),
            Match::CtOriginalAddrProtoPortInSet { set } => {
                format!("ct original {fam} daddr . meta l4proto . ct original proto-dst @{set}")
            }
            Match::CtOriginalProtoPortInSet { set } => {
                format!("meta l4proto . ct original proto-dst @{set}")
            }
            Match::Numgen { modulus, value } => format!("numgen random mod {modulus} {value}"),
            Match::MarkUnset { mask } => format!("meta mark & 0x{mask:08x} == 0x00000000"),
            Match::IifName {
                name,
                prefix,
                negate,
            } => {
                let op = if *negate { "!= " } else { "" };
                let star = if *prefix { "*" } else { "" };
                format!("iifname {op}\"{name}{star}\"")
            }
        });
    }
    parts.push(match &rule.action {
        Action::Verdict(v) => verdict_text(v),
        Action::VmapAddrProtoPort { map } => {
            format!("{fam} daddr . meta l4proto . th dport vmap @{map}")
        }
        Action::VmapProtoPort { map } => format!("meta l4proto . th dport vmap @{map}"),
        Action::Reject => "reject".to_string(),
        Action::Dnat { addr, port } => match addr {
            IpAddr::V4(a) => format!("dnat to {a}:{port}"),
            IpAddr::V6(a) => format!("dnat to [{a}]:{port}"),
        },
        Action::Masquerade => "masquerade fully-random".to_string(),
        Action::MarkOr(bits) => format!("meta mark set meta mark | 0x{bits:08x}"),
        Action::MarkXor(bits) => format!("meta mark set meta mark ^ 0x{bits:08x}"),
        Action::UpdateSaddr { set } => format!("update @{set} {{ {fam} saddr }}"),
        Action::DnatAffinity { map } => format!(
            "dnat {fam} to {fam} saddr . {fam} daddr . meta l4proto . th dport map @{map}"
        ),
        Action::UpdateAffinity { map, timeout_secs } => {
            // nft names the port by the protocol the rule matched.
            let proto = rule.matches.iter().find_map(|m| match m {
                Match::L4Proto(p) => Some(p.to_string()),
                _ => None,
            });
            let port = proto.unwrap_or_else(|| "th".to_string());
            format!(
                "update @{map} {{ {fam} saddr . ct original {fam} daddr . meta l4proto . ct \
                 original proto-dst timeout {} : {fam} daddr . {port} dport }}",
                duration_text(*timeout_secs)
            )
        }
        Action::DnatRegion { map, offset } => {
            let offset = if *offset == 0 {
                String::new()
            } else {
                format!(" offset {offset}")
            };
            format!("dnat {fam} to numgen random mod {REGION_MODULUS}{offset} map @{map}")
        }
        Action::SetDaddr { map, nodeport } => {
            let daddr = if *nodeport {
                String::new()
            } else {
                format!("{fam} daddr . ")
            };
            format!("{fam} daddr set {daddr}meta l4proto . th dport map @{map}")
        }
        Action::SetDport { map } => format!("tcp dport set meta l4proto . th dport map @{map}"),
        Action::DnatIndexed {
            map,
            nodeport,
            modulus,
        } => {
            let daddr = if *nodeport {
                String::new()
            } else {
                format!("{fam} daddr . ")
            };
            format!(
                "dnat {fam} to {daddr}meta l4proto . th dport . numgen random mod {modulus} map @{map}"
            )
        }
        Action::DnatShared {
            addresses,
            ports,
            modulus,
        } => format!(
            // As nft lists it (the family is implied by the address map's key).
            "dnat to {fam} daddr . meta l4proto . numgen random mod {modulus} map \
             @{addresses}:{fam} daddr . meta l4proto . th dport map @{ports}"
        ),
    });
    if let Some(c) = &rule.comment {
        parts.push(format!("comment {}", quote(c)));
    }
    parts.join(" ")
}

/// A duration as nft prints it: `3h`, `10m`, `1d2h3m4s`.
pub fn duration_text(secs: u32) -> String {
    if secs == 0 {
        return "0s".to_string();
    }
    let mut out = String::new();
    let mut rest = secs;
    for (unit, len) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        if rest >= len {
            let _ = write!(out, "{}{unit}", rest / len);
            rest %= len;
        }
    }
    out
}

/// A rule's text for fingerprinting; the family keyword is irrelevant there.
pub fn rule_text(rule: &Rule) -> String {
    rule_text_in(Family::V4, rule)
}

pub fn verdict_text(v: &Verdict) -> String {
    match v {
        Verdict::Accept => "accept".to_string(),
        Verdict::Drop => "drop".to_string(),
        Verdict::Return => "return".to_string(),
        Verdict::Jump(c) => format!("jump {c}"),
        Verdict::Goto(c) => format!("goto {c}"),
    }
}

fn quote(s: &str) -> String {
    // nft strings cannot contain double quotes; comments are generated by us and never do.
    format!("\"{}\"", s.replace('"', "'"))
}

pub fn key_type_text(family: Family, key: KeyType) -> &'static str {
    match (family, key) {
        (Family::V4, KeyType::Addr) => "ipv4_addr",
        (Family::V6, KeyType::Addr) => "ipv6_addr",
        (Family::V4, KeyType::AddrProtoPort) => "ipv4_addr . inet_proto . inet_service",
        (Family::V6, KeyType::AddrProtoPort) => "ipv6_addr . inet_proto . inet_service",
        (_, KeyType::ProtoPort) => "inet_proto . inet_service",
        (Family::V4, KeyType::AddrPair) => "ipv4_addr . ipv4_addr",
        (Family::V6, KeyType::AddrPair) => "ipv6_addr . ipv6_addr",
        (Family::V4, KeyType::Interval) => "numgen random mod 2 : ip daddr . th dport",
        (Family::V6, KeyType::Interval) => "numgen random mod 2 : ip6 daddr . th dport",
        (Family::V4, KeyType::AddrProtoPortIndex) => {
            "ip daddr . meta l4proto . th dport . numgen random mod 2 : ip daddr . th dport"
        }
        (Family::V6, KeyType::AddrProtoPortIndex) => {
            "ip6 daddr . meta l4proto . th dport . numgen random mod 2 : ip6 daddr . th dport"
        }
        (Family::V4, KeyType::ProtoPortIndex) => {
            "meta l4proto . th dport . numgen random mod 2 : ip daddr . th dport"
        }
        (Family::V6, KeyType::ProtoPortIndex) => {
            "meta l4proto . th dport . numgen random mod 2 : ip6 daddr . th dport"
        }
        (Family::V4, KeyType::AffinityClients) => {
            "ip saddr . ip daddr . meta l4proto . th dport : ip daddr . th dport"
        }
        (Family::V6, KeyType::AffinityClients) => {
            "ip6 saddr . ip6 daddr . meta l4proto . th dport : ip6 daddr . th dport"
        }
        (Family::V4, KeyType::AddrProtoPortToAddr) => {
            "ipv4_addr . inet_proto . inet_service : ipv4_addr"
        }
        (Family::V6, KeyType::AddrProtoPortToAddr) => {
            "ipv6_addr . inet_proto . inet_service : ipv6_addr"
        }
        (Family::V4, KeyType::ProtoPortToAddr) => "inet_proto . inet_service : ipv4_addr",
        (Family::V6, KeyType::ProtoPortToAddr) => "inet_proto . inet_service : ipv6_addr",
        (_, KeyType::ProtoPortToPort) => "inet_proto . inet_service : inet_service",
        (Family::V4, KeyType::AddrProto) => "ipv4_addr . inet_proto",
        (Family::V6, KeyType::AddrProto) => "ipv6_addr . inet_proto",
        (Family::V4, KeyType::AddrProtoIndex) => {
            "ip daddr . meta l4proto . numgen random mod 2 : ip daddr"
        }
        (Family::V6, KeyType::AddrProtoIndex) => {
            "ip6 daddr . meta l4proto . numgen random mod 2 : ip6 daddr"
        }
        (Family::V4, KeyType::AddrProtoPortToPort) => {
            "ipv4_addr . inet_proto . inet_service : inet_service"
        }
        (Family::V6, KeyType::AddrProtoPortToPort) => {
            "ipv6_addr . inet_proto . inet_service : inet_service"
        }
    }
}

pub fn key_text(key: &Key) -> String {
    match key {
        Key::Addr(a) => a.to_string(),
        Key::AddrProtoPort(a, p, port) => format!("{a} . {p} . {port}"),
        Key::ProtoPort(p, port) => format!("{p} . {port}"),
        Key::AddrPair(a) => format!("{a} . {a}"),
        Key::Interval { at, end } => format!("{at}-{}", end.wrapping_sub(1)),
        Key::AddrProtoPortIndex(a, p, port, i) => format!("{a} . {p} . {port} . {i}"),
        Key::ProtoPortIndex(p, port, i) => format!("{p} . {port} . {i}"),
        Key::AddrProto(a, p) => format!("{a} . {p}"),
        Key::AddrProtoIndex(a, p, i) => format!("{a} . {p} . {i}"),
    }
}

fn element_text(key: &Key, value: Option<&Value>) -> String {
    match value {
        Some(Value::Verdict(v)) => format!("{} : {}", key_text(key), verdict_text(v)),
        Some(Value::Endpoint(addr, port)) => format!("{} : {addr} . {port}", key_text(key)),
        Some(Value::Addr(addr)) => format!("{} : {addr}", key_text(key)),
        Some(Value::Port(port)) => format!("{} : {port}", key_text(key)),
        None => key_text(key),
    }
}

fn base_chain_text(b: &BaseChain) -> String {
    let t = match b.chain_type {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    };
    format!(
        "type {t} hook {} priority {}; policy accept;",
        b.hook.name(),
        b.priority
    )
}

/// `map` or `set`.
fn set_kind(decl: &SetDecl) -> &'static str {
    if decl.is_vmap || decl.key.has_data() {
        "map"
    } else {
        "set"
    }
}

fn set_decl_lines(family: Family, decl: &SetDecl, out: &mut String, indent: &str) {
    if decl.key.declared_by_typeof() {
        let _ = writeln!(out, "{indent}typeof {}", key_type_text(family, decl.key));
        if decl.key == KeyType::Interval {
            let _ = writeln!(out, "{indent}flags interval");
        }
    } else {
        let value = if decl.is_vmap { " : verdict" } else { "" };
        let _ = writeln!(
            out,
            "{indent}type {}{value}",
            key_type_text(family, decl.key)
        );
    }
    if let Some(t) = decl.timeout_secs {
        let _ = writeln!(out, "{indent}flags dynamic,timeout");
        let _ = writeln!(out, "{indent}timeout {}", duration_text(t));
    }
    if let Some(size) = decl.size {
        let _ = writeln!(out, "{indent}size {size}");
    }
    if let Some(c) = &decl.comment {
        let _ = writeln!(out, "{indent}comment {}", quote(c));
    }
}

/// The whole table as one `nft -f` document (what `nftproxy render` prints).
pub fn table_text(table: &Table) -> String {
    let fam = table.family.nft_name();
    let mut out = String::new();
    let _ = writeln!(out, "table {fam} {TABLE} {{");
    let _ = writeln!(out, "\tcomment {}", quote(TABLE_COMMENT));
    for (name, set) in &table.sets {
        let _ = writeln!(out, "\t{} {name} {{", set_kind(&set.decl));
        set_decl_lines(table.family, &set.decl, &mut out, "\t\t");
        if !set.elements.is_empty() {
            let elems: Vec<String> = set
                .elements
                .iter()
                .map(|(k, v)| element_text(&k, v.as_ref()))
                .collect();
            let _ = writeln!(out, "\t\telements = {{ {} }}", elems.join(",\n\t\t\t     "));
        }
        let _ = writeln!(out, "\t}}");
    }
    for (name, chain) in &table.chains {
        let _ = writeln!(out, "\tchain {name} {{");
        if let Some(c) = &chain.comment {
            let _ = writeln!(out, "\t\tcomment {}", quote(c));
        }
        if let Some(b) = &chain.base {
            let _ = writeln!(out, "\t\t{}", base_chain_text(b));
        }
        for rule in chain.rules.iter() {
            let _ = writeln!(out, "\t\t{}", rule_text_in(table.family, rule));
        }
        let _ = writeln!(out, "\t}}");
    }
    let _ = writeln!(out, "}}");
    out
}

/// A transaction as `nft -f` commands, for logs and for `nft`-based comparisons.
pub fn transaction_text(tx: &Transaction) -> String {
    let f = tx.family.nft_name();
    let mut out = String::new();
    for op in &tx.ops {
        let line = match op {
            Op::AddTable => format!(
                "add table {f} {TABLE} {{ comment {} ; }}",
                quote(TABLE_COMMENT)
            ),
            Op::DeleteTable => format!("delete table {f} {TABLE}"),
            Op::AddChain {
                name,
                base,
                comment,
                ..
            } => {
                let mut spec = String::new();
                if let Some(b) = base {
                    spec.push_str(&base_chain_text(b));
                    spec.push(' ');
                }
                if let Some(c) = comment {
                    spec.push_str(&format!("comment {} ; ", quote(c)));
                }
                if spec.is_empty() {
                    format!("add chain {f} {TABLE} {name}")
                } else {
                    format!("add chain {f} {TABLE} {name} {{ {spec}}}")
                }
            }
            Op::FlushChain { name } => format!("flush chain {f} {TABLE} {name}"),
            Op::DeleteChain { name } => format!("delete chain {f} {TABLE} {name}"),
            Op::AddRules { chain, rules } => rules
                .iter()
                .map(|rule| {
                    format!(
                        "add rule {f} {TABLE} {chain} {}",
                        rule_text_in(tx.family, rule)
                    )
                })
                .collect::<Vec<_>>()
                .join("\n"),
            Op::AddSet { name, decl } => {
                let mut body = String::new();
                set_decl_lines(tx.family, decl, &mut body, "");
                let kind = set_kind(decl);
                format!(
                    "add {kind} {f} {TABLE} {name} {{ {} }}",
                    body.trim_end().replace('\n', " ; ") + " ;"
                )
            }
            Op::DeleteSet { name } => format!("delete set {f} {TABLE} {name}"),
            Op::AddElements { set, elements } => {
                let elems: Vec<String> = elements
                    .iter()
                    .map(|(k, v)| element_text(&k, v.as_ref()))
                    .collect();
                format!("add element {f} {TABLE} {set} {{ {} }}", elems.join(", "))
            }
            Op::DeleteElements { set, keys } => {
                let elems: Vec<String> = keys.iter().map(key_text).collect();
                format!(
                    "delete element {f} {TABLE} {set} {{ {} }}",
                    elems.join(", ")
                )
            }
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::duration_text;

    #[test]
    fn durations_read_as_nft_prints_them() {
        assert_eq!(duration_text(10_800), "3h");
        assert_eq!(duration_text(600), "10m");
        assert_eq!(duration_text(86_400), "1d");
        assert_eq!(duration_text(93_784), "1d2h3m4s");
        assert_eq!(duration_text(1), "1s");
    }
}
