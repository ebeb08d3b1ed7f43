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
