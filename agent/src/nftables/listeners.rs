//! Whether another process listens to nf_tables change notifications in this network
//! namespace (`nft monitor`, a CNI or monitoring agent). While one does, the kernel builds a
//! notification for every element of every transaction, so a cold start commits its table in
//! smaller parts (see `dataplane::nft::cold`).

use std::collections::HashSet;
use std::fs;

use netlink_sys::protocols::NETLINK_NETFILTER;

use super::monitor::NFNLGRP_NFTABLES;

/// Whether a netlink socket of another process in the calling thread's network namespace is
/// subscribed to nf_tables notifications. False when that cannot be read (no `/proc`).
pub fn others_listen() -> bool {
    // The thread's namespace: a thread may have entered another one than its process's.
    let Ok(table) = fs::read_to_string("/proc/thread-self/net/netlink") else {
        return false;
    };
    let listeners: Vec<u64> = nftables_listeners(&table).collect();
    // Our own sockets are read only when there is a listener to tell apart.
    !listeners.is_empty() && {
        let own = own_sockets();
        listeners.iter().any(|inode| !own.contains(inode))
    }
}

/// The inodes of the sockets `/proc/net/netlink` (`table`) shows subscribed to nf_tables
/// notifications. Its `Groups` column holds the first 32 groups as a hexadecimal mask.
fn nftables_listeners(table: &str) -> impl Iterator<Item = u64> + '_ {
    let bit = 1u32 << (NFNLGRP_NFTABLES - 1);
    table.lines().skip(1).filter_map(move |line| {
        // sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
        let fields: Vec<&str> = line.split_whitespace().collect();
        let protocol: isize = fields.get(1)?.parse().ok()?;
        let groups = u32::from_str_radix(fields.get(3)?, 16).ok()?;
        let inode: u64 = fields.get(9)?.parse().ok()?;
        (protocol == NETLINK_NETFILTER && groups & bit != 0).then_some(inode)
    })
}

/// The inodes of this process's sockets (its own nf_tables monitor among them).
fn own_sockets() -> HashSet<u64> {
    let Ok(fds) = fs::read_dir("/proc/self/fd") else {
        return HashSet::new();
    };
    fds.filter_map(|fd| {
        let target = fs::read_link(fd.ok()?.path()).ok()?;
        let inode = target
            .to_str()?
            .strip_prefix("socket:[")?
            .strip_suffix(']')?;
        inode.parse().ok()
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/net/netlink` of a namespace where `nft monitor` (inode 14271967) listens, beside
    /// the kernel's own sockets and one of NETLINK_ROUTE with groups of its own.
    const TABLE: &str = "\
sk               Eth Pid        Groups   Rmem     Wmem     Dump  Locks    Drops    Inode
00000000566c4900 0   0          00000000 0        0        0     2        0        13248481
00000000fe45b23a 0   16917      00000040 0        0        0     2        0        13248490
00000000c92643a7 12  0          00000000 0        0        0     2        0        13248488
00000000d61de608 12  16916      00000040 0        0        0     2        0        14271967
00000000d61de609 12  16918      00000004 0        0        0     2        0        14271968
garbage
";

    #[test]
    fn finds_nftables_listeners_by_protocol_and_group() {
        assert_eq!(nftables_listeners(TABLE).collect::<Vec<_>>(), [14271967]);
        assert_eq!(nftables_listeners("").count(), 0);
    }

    #[test]
    fn knows_this_process_sockets() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let (a, _b) = std::os::unix::net::UnixDatagram::pair().expect("a socket pair");
        let inode = fs::metadata(format!("/proc/self/fd/{}", a.as_raw_fd()))
            .expect("our descriptor")
            .ino();
        assert!(own_sockets().contains(&inode));
    }
}
