//! This host's IP addresses (for CIDR `nodePortAddresses`).

use std::net::IpAddr;

/// Every address configured on this host's interfaces, in the current network namespace.
/// An unreadable interface list yields no addresses (and a warning): NodePorts restricted to
/// CIDRs then match nothing until the next sync, rather than everything.
pub fn local_addresses() -> Vec<IpAddr> {
    match if_addrs::get_if_addrs() {
        Ok(list) => list.into_iter().map(|i| i.ip()).collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list local addresses");
            Vec::new()
        }
    }
}

/// rtnetlink multicast groups of address changes (`RTNLGRP_IPV4_IFADDR`, `RTNLGRP_IPV6_IFADDR`).
const RTNLGRP_IPV4_IFADDR: u32 = 5;
const RTNLGRP_IPV6_IFADDR: u32 = 9;

/// Subscribes to rtnetlink address notifications in the calling thread's network namespace.
pub struct AddressWatch {
    sock: netlink_sys::Socket,
    buf: Vec<u8>,
}

impl AddressWatch {
    pub fn open() -> std::io::Result<AddressWatch> {
        let mut sock = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.add_membership(RTNLGRP_IPV4_IFADDR)?;
        sock.add_membership(RTNLGRP_IPV6_IFADDR)?;
        Ok(AddressWatch {
            sock,
            buf: vec![0; 1 << 16],
        })
    }

    /// Blocks until an address is added or removed (or notifications were lost), then
    /// swallows the burst that usually follows (an interface going down drops several).
    pub fn wait(&mut self) -> std::io::Result<()> {
        loop {
            match self.sock.recv(&mut &mut self.buf[..], 0) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        while self
            .sock
            .recv(&mut &mut self.buf[..], libc::MSG_DONTWAIT)
            .is_ok()
        {}
        Ok(())
    }
}
