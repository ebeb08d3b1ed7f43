//! The shared address lists (a set of ClusterIP and protocol, the list of addresses, the
//! target ports, and the DNAT that reads both) against the kernel: the table the agent writes
//! is the one `nft -f` writes from the rendered text, down to the expressions, registers and
//! elements `nft --debug=netlink` shows, and it reads back as written.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::*;
use dataplane::nft::build::shared::{SERVICE_ENDPOINTS, SERVICE_TARGET_PORTS, class_set};

/// The objects of the shared lists, with the names the builder gives them.
pub(super) fn shared_table(family: Family) -> Table {
    let (vip, ep, ep2) = match family {
        Family::V4 => (ip("10.96.0.10"), ip("10.244.1.2"), ip("10.244.2.3")),
        Family::V6 => (ip("fd00::10"), ip("fd00::1:2"), ip("fd00::2:3")),
    };
    let decl = |key, comment: Option<&str>| SetDecl {
        comment: comment.map(Into::into),
        size: Some(96),
        ..SetDecl::new(key)
    };
    let mut t = Table::new(family);
    let mut class = ElementMap::new();
    for p in [Proto::Tcp, Proto::Udp] {
        class.insert(Key::AddrProto(vip, p), None);
    }
    let mut addresses = ElementMap::new();
    for (i, e) in [ep, ep2].into_iter().enumerate() {
        addresses.insert(
            Key::AddrProtoIndex(vip, Proto::Tcp, i as u16),
            Some(Value::Addr(e)),
        );
    }
    addresses.insert(
        Key::AddrProtoIndex(vip, Proto::Udp, 0),
        Some(Value::Addr(ep2)),
    );
    let mut ports = ElementMap::new();
    for (p, port, target) in [
        (Proto::Tcp, 80, 8080),
        (Proto::Tcp, 443, 8443),
        (Proto::Udp, 53, 5353),
    ] {
        ports.insert(Key::AddrProtoPort(vip, p, port), Some(Value::Port(target)));
    }
    t.sets.insert(
        class_set(5).into(),
        Set::new(decl(KeyType::AddrProto, Some("c")), class),
    );
    t.sets.insert(
        SERVICE_ENDPOINTS.into(),
        Set::new(decl(KeyType::AddrProtoIndex, None), addresses),
    );
    t.sets.insert(
        SERVICE_TARGET_PORTS.into(),
        Set::new(decl(KeyType::AddrProtoPortToPort, Some("ports")), ports),
    );
    let dnat = |modulus| Action::DnatShared {
        addresses: SERVICE_ENDPOINTS,
        ports: SERVICE_TARGET_PORTS,
        modulus,
    };
    t.chains.insert(
        "nat-prerouting".into(),
        base(
            ChainType::Nat,
            Hook::Prerouting,
            -100,
            vec![
                Rule::new(
                    vec![Match::AddrProtoInSet {
                        set: class_set(5).into(),
                    }],
                    goto("big-service-5"),
                ),
                Rule::new(vec![], dnat(1)),
            ],
        ),
    );
    t.chains.insert(
        "big-service-5".into(),
        regular(None, vec![Rule::new(vec![], dnat(32))]),
    );
    t
}

/// `nft --debug=netlink list table` without what differs between two loads of one table:
/// rule handles and positions, and the order nft lists elements and objects in (rules keep
/// theirs within a chain).
fn netlink_listing(ns: &Netns, family: Family) -> (Vec<(String, Vec<String>)>, Vec<String>) {
    let (ok, out) = ns.nft(&[
        "--debug=netlink",
        "list",
        "table",
        family.nft_name(),
        "nftproxy",
    ]);
    assert!(ok, "nft --debug=netlink list failed: {out}");
    let (debug, text) = out.split_at(out.find("\ntable ").expect("a listing") + 1);
    let mut blocks: Vec<(String, Vec<String>)> = Vec::new();
    for line in debug.lines().filter(|l| !l.trim().is_empty()) {
        if line.starts_with(char::is_whitespace) {
            blocks
                .last_mut()
                .expect("a header")
                .1
                .push(line.trim().to_string());
            continue;
        }
        // `ip nftproxy CHAIN HANDLE [POSITION]`, `ip nftproxy @SET`.
        let header: Vec<&str> = line
            .split_whitespace()
            .take_while(|w| w.parse::<u64>().is_err())
            .collect();
        blocks.push((header.join(" "), Vec::new()));
    }
    for (header, lines) in &mut blocks {
        if header.contains('@') {
            lines.sort();
        }
    }
    blocks.sort_by(|a, b| a.0.cmp(&b.0));
    (blocks, normalise(text, false))
}

/// The sets of table nftproxy as the kernel dumps them, each as its attributes but the
/// handle, sorted: names, flags, key and data types and lengths, size and user data, byte
/// for byte. `nft list` prints the same text for some other bytes.
fn raw_sets(ns: &Netns, family: Family) -> Vec<Vec<(u16, Vec<u8>)>> {
    const NFT_MSG_GETSET: u16 = (10 << 8) | 10;
    const NFTA_SET_TABLE: u16 = 1;
    const NFTA_SET_HANDLE: u16 = 16;
    let nfproto = match family {
        Family::V4 => 2u8,
        Family::V6 => 10,
    };
    let attrs = |mut b: &[u8]| {
        let mut out = Vec::new();
        while b.len() >= 4 {
            let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
            let kind = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
            out.push((kind, b[4..len].to_vec()));
            b = b.get((len + 3) & !3..).unwrap_or_default();
        }
        out
    };
    ns.run(move || {
        // SAFETY: a plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_NETFILTER,
            )
        };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: fd is a new socket nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut msg = vec![0u8; 16];
        msg.extend([nfproto, 0, 0, 0]);
        msg.extend(13u16.to_ne_bytes());
        msg.extend(NFTA_SET_TABLE.to_ne_bytes());
        msg.extend(b"nftproxy\0\0\0\0");
        let len = msg.len() as u32;
        msg[..4].copy_from_slice(&len.to_ne_bytes());
        msg[4..6].copy_from_slice(&NFT_MSG_GETSET.to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
        msg[6..8].copy_from_slice(&flags.to_ne_bytes());
        // SAFETY: msg is a valid buffer of its length.
        let sent = unsafe { libc::send(fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        assert_eq!(
            sent,
            msg.len() as isize,
            "{}",
            std::io::Error::last_os_error()
        );
        let mut sets = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            // SAFETY: buf is a valid buffer of its length.
            let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            assert!(n > 0, "recv: {}", std::io::Error::last_os_error());
            let mut rest = &buf[..n as usize];
            while rest.len() >= 16 {
                let len = u32::from_ne_bytes(rest[..4].try_into().unwrap()) as usize;
                match u16::from_ne_bytes([rest[4], rest[5]]) {
                    t if t == libc::NLMSG_DONE as u16 => return sets,
                    t if t == libc::NLMSG_ERROR as u16 => panic!("set dump failed: {rest:?}"),
                    _ => {}
                }
                let mut set = attrs(&rest[20..len]);
                set.retain(|(k, _)| *k != NFTA_SET_HANDLE);
                set.sort();
                sets.push(set);
                rest = rest.get((len + 3) & !3..).unwrap_or_default();
            }
        }
    })
}

fn check_shared_lists(family: Family) {
    let table = shared_table(family);
    let ns = Netns::new("shared");
    let mut nft = ns.open();
    let tx = plan(None, &Before::Nothing, &table);
    nft.apply(&tx).expect("apply the shared lists");

    let ip = family.nft_name();
    let listed = ns.list(family);
    let (addr_type, addr) = match family {
        Family::V4 => ("ipv4_addr", "10.96.0.10"),
        Family::V6 => ("ipv6_addr", "fd00::10"),
    };
    for want in [
        format!("type {addr_type} . inet_proto"),
        format!("elements = {{ {addr} . tcp, {addr} . udp }}"),
        format!("typeof {ip} daddr . meta l4proto . numgen random mod 2 : {ip} daddr"),
        format!("type {addr_type} . inet_proto . inet_service : inet_service"),
        format!("{ip} daddr . meta l4proto @big-service-class-5 goto big-service-5"),
        format!(
            "dnat to {ip} daddr . meta l4proto . numgen random mod 32 map \
             @big-service-endpoints:{ip} daddr . meta l4proto . th dport map \
             @service-target-ports"
        ),
        format!(
            "dnat to {ip} daddr . meta l4proto . numgen random mod 1 map \
             @big-service-endpoints:{ip} daddr . meta l4proto . th dport map \
             @service-target-ports"
        ),
    ] {
        assert!(
            collapse(&listed).contains(&want),
            "{family:?}: no `{want}` in\n{listed}"
        );
    }
    for element in [". 0 :", ". 1 :", ". 80 : 8080"] {
        assert!(listed.contains(element), "{family:?}: no `{element}`");
    }

    // The same table loaded by nft from the rendered text.
    let by_nft = Netns::new("shared-f");
    let path = std::env::temp_dir().join(format!("{}.nft", by_nft.name));
    std::fs::write(&path, render::table_text(&table)).unwrap();
    let (ok, _, err) = by_nft.try_exec(&["nft", "-f", path.to_str().unwrap()]);
    std::fs::remove_file(&path).ok();
    assert!(ok, "{family:?}: nft -f refused the rendered table: {err}");
    let mut sets = [raw_sets(&ns, family), raw_sets(&by_nft, family)];
    for s in &mut sets {
        s.sort();
    }
    assert_eq!(sets[0].len(), 3, "{family:?}");
    assert_eq!(sets[0], sets[1], "{family:?}: the set declarations differ");
    let (ours, ours_text) = netlink_listing(&ns, family);
    let (nfts, nfts_text) = netlink_listing(&by_nft, family);
    assert_eq!(ours_text, nfts_text, "{family:?}: the listings differ");
    assert_eq!(ours, nfts, "{family:?}: the netlink expressions differ");
    assert!(
        ours.iter()
            .any(|(_, lines)| lines.iter().any(|l| l.contains("flags 0x3"))),
        "{family:?}: {ours:?}"
    );

    // A second sync has nothing to send; so has one against the table nft wrote.
    let state = assert_idempotent(&mut nft, &table);
    let mut tracked = TableState::default();
    tracked.apply(&tx);
    assert!(
        tracked.agrees_with(&state, &table),
        "{state:?}\n{tracked:?}"
    );
    assert_idempotent(&mut by_nft.open(), &table);
}

#[test]
fn shared_lists_ipv4_are_what_nft_writes_and_read_back() {
    nftproxy_tests::require_root!();
    check_shared_lists(Family::V4);
}

#[test]
fn shared_lists_ipv6_are_what_nft_writes_and_read_back() {
    nftproxy_tests::require_root!();
    check_shared_lists(Family::V6);
}
