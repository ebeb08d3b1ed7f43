//! This host's IP addresses (for CIDR `nodePortAddresses`), from rtnetlink: a dump of the
//! kernel's address table, then its address notifications applied one message at a time.
//! Messages are `netlink-packet-route`'s typed address messages; the sockets are `netlink-sys`'s.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_sys::{Socket, protocols::NETLINK_ROUTE};

/// How long a change waits for the rest of its burst (an interface going down drops several
/// addresses) before the sync loop is woken, once for all of it.
const BURST: Duration = Duration::from_millis(100);

/// A dump interrupted by concurrent changes (`NLM_F_DUMP_INTR`) is retried this many times.
const DUMP_ATTEMPTS: usize = 5;

/// What identifies one configured address besides its IP: the interface and the prefix length
/// (the same IP may be configured more than once; it stays local until the last one goes).
type Assignment = (u32, u8);

/// The addresses configured on this host's interfaces, as rtnetlink reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressTable {
    by_ip: BTreeMap<IpAddr, BTreeSet<Assignment>>,
}

impl AddressTable {
    /// The distinct local IPs, sorted.
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.by_ip.keys().copied().collect()
    }

    /// Applies one rtnetlink message (`RTM_NEWADDR`, `RTM_DELADDR`; others are ignored).
    /// Returns whether the set of local IPs changed.
    pub fn apply(&mut self, msg: &RouteNetlinkMessage) -> bool {
        match msg {
            RouteNetlinkMessage::NewAddress(m) => self.add(m),
            RouteNetlinkMessage::DelAddress(m) => self.remove(m),
            _ => false,
        }
    }

    fn add(&mut self, msg: &AddressMessage) -> bool {
        let Some((ip, assignment)) = entry(msg) else {
            return false;
        };
        let assignments = self.by_ip.entry(ip).or_default();
        let fresh = assignments.is_empty();
        assignments.insert(assignment);
        fresh
    }

    fn remove(&mut self, msg: &AddressMessage) -> bool {
        let Some((ip, assignment)) = entry(msg) else {
            return false;
        };
        let Some(assignments) = self.by_ip.get_mut(&ip) else {
            return false;
        };
        assignments.remove(&assignment);
        let gone = assignments.is_empty();
        if gone {
            self.by_ip.remove(&ip);
        }
        gone
    }
}

/// The local IP of an address message: `IFA_LOCAL` if present (on point-to-point links
/// `IFA_ADDRESS` is the peer's), else `IFA_ADDRESS`, as `getifaddrs` reports it.
fn entry(msg: &AddressMessage) -> Option<(IpAddr, Assignment)> {
    let local = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let ip = local.or_else(|| {
        msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })?;
    Some((ip, (msg.header.index, msg.header.prefix_len)))
}

/// Every address configured on this host's interfaces, in the calling thread's network
/// namespace (one dump). An unreadable address table yields no addresses (and a warning):
/// NodePorts restricted to CIDRs then match nothing until the next sync, rather than everything.
pub fn local_addresses() -> Vec<IpAddr> {
    match dump() {
        Ok(table) => table.addresses(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list local addresses");
            Vec::new()
        }
    }
}

/// The kernel's address table, read with an `RTM_GETADDR` dump on a socket of its own.
pub fn dump() -> io::Result<AddressTable> {
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    sock.bind_auto()?;
    let mut buf = vec![0; 1 << 16];
    for seq in 1..=DUMP_ATTEMPTS as u32 {
        let mut req =
            NetlinkMessage::from(RouteNetlinkMessage::GetAddress(AddressMessage::default()));
        req.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        req.header.sequence_number = seq;
        req.finalize();
        let mut bytes = vec![0; req.buffer_len()];
        req.serialize(&mut bytes);
        sock.send(&bytes, 0)?;
        let mut table = AddressTable::default();
        let mut interrupted = false;
        'reply: loop {
            let n = recv(&sock, &mut buf, 0)?;
            for msg in messages(&buf[..n])? {
                if msg.header.sequence_number != seq {
                    continue; // A reply to an earlier, abandoned attempt.
                }
                interrupted |= msg.header.flags & NLM_F_DUMP_INTR != 0;
                match msg.payload {
                    NetlinkPayload::InnerMessage(m) => {
                        table.apply(&m);
                    }
                    NetlinkPayload::Done(_) => break 'reply,
                    NetlinkPayload::Error(e) => return Err(e.to_io()),
                    _ => {}
                }
            }
        }
        if !interrupted {
            return Ok(table);
        }
    }
    Err(io::Error::other(
        "the address dump kept being interrupted by changes",
    ))
}

/// The rtnetlink messages of one datagram.
fn messages(mut datagram: &[u8]) -> io::Result<Vec<NetlinkMessage<RouteNetlinkMessage>>> {
    let mut out = Vec::new();
    while !datagram.is_empty() {
        let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(datagram)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        // Messages are 4-byte aligned within a datagram.
        let len = (msg.header.length as usize).next_multiple_of(4);
        if len == 0 {
            break;
        }
        datagram = datagram.get(len..).unwrap_or_default();
        out.push(msg);
    }
    Ok(out)
}

fn recv(sock: &Socket, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    loop {
        match sock.recv(&mut &mut buf[..], flags) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// The address table the watcher keeps current, shared with the sync loop. Empty while the
/// watcher has none (not started yet, or it could not be opened): readers then dump.
#[derive(Clone, Debug, Default)]
pub struct LocalAddresses {
    watched: Arc<Mutex<Option<Vec<IpAddr>>>>,
}

impl LocalAddresses {
    /// This host's addresses: the watcher's, or else a fresh dump.
    pub fn current(&self) -> Vec<IpAddr> {
        let watched = self.lock().clone();
        watched.unwrap_or_else(local_addresses)
    }

    fn publish(&self, addresses: Option<Vec<IpAddr>>) {
        *self.lock() = addresses;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<IpAddr>>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Subscribes to rtnetlink address notifications in the calling thread's network namespace
/// and keeps the address table they describe.
pub struct AddressWatch {
    sock: Socket,
    buf: Vec<u8>,
    table: AddressTable,
}

impl AddressWatch {
    /// Subscribes, then dumps: a change during the dump also arrives as a notification, and
    /// applying it again is harmless.
    pub fn open() -> io::Result<AddressWatch> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.add_membership(libc::RTNLGRP_IPV4_IFADDR)?;
        sock.add_membership(libc::RTNLGRP_IPV6_IFADDR)?;
        Ok(AddressWatch {
            sock,
            buf: vec![0; 1 << 16],
            table: dump()?,
        })
    }

    pub fn addresses(&self) -> Vec<IpAddr> {
        self.table.addresses()
    }

    /// Blocks until the set of local IPs changed, applying each notification as it comes,
    /// then takes in the rest of the burst. Lost notifications (`ENOBUFS`) or an unreadable
    /// one are recovered from with a fresh dump.
    pub fn wait(&mut self) -> io::Result<()> {
        while !self.receive(0)? {}
        let end = Instant::now() + BURST;
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            std::thread::sleep(left.min(Duration::from_millis(10)));
            while self.receive(libc::MSG_DONTWAIT)? {}
        }
        Ok(())
    }

    /// Reads one datagram (none if `MSG_DONTWAIT` and nothing is queued) and applies it.
    /// Returns whether the set of local IPs changed.
    fn receive(&mut self, flags: libc::c_int) -> io::Result<bool> {
        let n = match recv(&self.sock, &mut self.buf, flags) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => return self.redump(),
            Err(e) => return Err(e),
        };
        let Ok(msgs) = messages(&self.buf[..n]) else {
            return self.redump();
        };
        let mut changed = false;
        for msg in msgs {
            match msg.payload {
                NetlinkPayload::InnerMessage(m) => changed |= self.table.apply(&m),
                NetlinkPayload::Overrun(_) => changed |= self.redump()?,
                _ => {}
            }
        }
        Ok(changed)
    }

    fn redump(&mut self) -> io::Result<bool> {
        let fresh = dump()?;
        let changed = fresh.by_ip.keys().ne(self.table.by_ip.keys());
        self.table = fresh;
        Ok(changed)
    }
}

/// Follows address changes for as long as the process runs: publishes the table into
/// `shared` and calls `changed` whenever it differs. If the watch cannot be opened, readers
/// of `shared` keep dumping on their own; if it fails later, it is reopened.
pub fn follow(shared: &LocalAddresses, changed: impl Fn()) {
    let mut watch = match AddressWatch::open() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch address changes; NodePort addresses follow them at the next sync");
            return;
        }
    };
    shared.publish(Some(watch.addresses()));
    loop {
        // After a failure, what changed while the watch was down is not known: the reopened
        // watch's dump counts as a change.
        if let Err(e) = watch.wait() {
            tracing::warn!(error = %e, "address change watch failed; reopening it");
            shared.publish(None);
            watch = reopen();
        }
        shared.publish(Some(watch.addresses()));
        changed();
    }
}

/// Opens the watch again, retrying with growing pauses (1 s to a minute).
fn reopen() -> AddressWatch {
    let mut pause = Duration::from_secs(1);
    loop {
        std::thread::sleep(pause);
        match AddressWatch::open() {
            Ok(w) => return w,
            Err(e) => tracing::warn!(error = %e, "cannot reopen the address watch"),
        }
        pause = (pause * 2).min(Duration::from_secs(60));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::AddressFamily;

    fn msg(index: u32, prefix_len: u8, attrs: Vec<AddressAttribute>) -> AddressMessage {
        let v6 = attrs.iter().any(|a| {
            matches!(a, AddressAttribute::Address(ip) | AddressAttribute::Local(ip) if ip.is_ipv6())
        });
        let mut m = AddressMessage::default();
        m.header.family = if v6 {
            AddressFamily::Inet6
        } else {
            AddressFamily::Inet
        };
        m.header.index = index;
        m.header.prefix_len = prefix_len;
        m.attributes = attrs;
        m
    }

    fn addr(index: u32, ip: &str) -> AddressMessage {
        let ip: IpAddr = ip.parse().unwrap();
        msg(index, 24, vec![AddressAttribute::Address(ip)])
    }

    fn ips(t: &AddressTable) -> Vec<String> {
        t.addresses().iter().map(|i| i.to_string()).collect()
    }

    #[test]
    fn notifications_are_applied_one_at_a_time() {
        let mut t = AddressTable::default();
        assert!(t.apply(&RouteNetlinkMessage::NewAddress(addr(2, "192.168.0.2"))));
        assert!(t.apply(&RouteNetlinkMessage::NewAddress(addr(3, "fd00::1"))));
        // A repeated notification (IPv6 DAD finishing, a flags change) changes nothing.
        assert!(!t.apply(&RouteNetlinkMessage::NewAddress(addr(2, "192.168.0.2"))));
        assert_eq!(ips(&t), ["192.168.0.2", "fd00::1"]);
        assert!(t.apply(&RouteNetlinkMessage::DelAddress(addr(2, "192.168.0.2"))));
        assert_eq!(ips(&t), ["fd00::1"]);
        // Deleting what is not there (a dump that already missed it) is harmless.
        assert!(!t.apply(&RouteNetlinkMessage::DelAddress(addr(2, "192.168.0.2"))));
    }

    #[test]
    fn an_ip_on_two_interfaces_stays_until_the_last_goes() {
        let mut t = AddressTable::default();
        t.apply(&RouteNetlinkMessage::NewAddress(addr(2, "10.0.0.1")));
        assert!(!t.apply(&RouteNetlinkMessage::NewAddress(addr(3, "10.0.0.1"))));
        assert!(!t.apply(&RouteNetlinkMessage::DelAddress(addr(2, "10.0.0.1"))));
        assert_eq!(ips(&t), ["10.0.0.1"]);
        assert!(t.apply(&RouteNetlinkMessage::DelAddress(addr(3, "10.0.0.1"))));
        assert!(t.addresses().is_empty());
    }

    #[test]
    fn the_local_address_wins_over_a_point_to_point_peer() {
        let mut t = AddressTable::default();
        let ptp = msg(
            4,
            32,
            vec![
                AddressAttribute::Address("10.9.0.2".parse().unwrap()),
                AddressAttribute::Local("10.9.0.1".parse().unwrap()),
            ],
        );
        t.apply(&RouteNetlinkMessage::NewAddress(ptp));
        assert_eq!(ips(&t), ["10.9.0.1"]);
        // Without an address attribute there is nothing to apply.
        assert!(!t.apply(&RouteNetlinkMessage::NewAddress(msg(4, 32, vec![]))));
    }

    #[test]
    fn datagrams_are_split_into_messages() {
        let mut datagram = Vec::new();
        for m in [addr(2, "192.168.0.2"), addr(3, "fd00::1")] {
            let mut nl = NetlinkMessage::from(RouteNetlinkMessage::NewAddress(m));
            nl.finalize();
            let mut bytes = vec![0; nl.buffer_len()];
            nl.serialize(&mut bytes);
            datagram.extend(bytes);
        }
        let msgs = messages(&datagram).unwrap();
        assert_eq!(msgs.len(), 2);
        // A truncated datagram is an error, not a panic.
        assert!(messages(&datagram[..datagram.len() - 3]).is_err());
    }
}
