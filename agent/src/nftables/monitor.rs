//! Watches nf_tables change notifications for changes to nftproxy's tables made by anyone else
//! (`nft delete table ip nftproxy`, `nft flush ruleset`, a hand-edited rule), so the agent can
//! repair them within moments instead of at the next periodic full sync.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dataplane::nft::ruleset::TABLE;
use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

use super::Nftables;

/// The multicast group of nf_tables change notifications.
pub(crate) const NFNLGRP_NFTABLES: u32 = libc::NFNLGRP_NFTABLES as u32;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
/// First attribute of table, chain, rule, set and element messages: the table's name.
const NFTA_TABLE_ATTR: u16 = 1;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
/// Room for the notifications of small transactions (large ones of our own are not notified,
/// see [`Quieter`]). Someone else's large change overflows it, which counts as possible drift
/// like any foreign change; the kernel then stops queueing copies for us. A much larger buffer
/// made such changes slower: `nft delete table` of our table at 30k Services took 1.1–7.2 s
/// (median 2.7) with 64 MiB, against 1.1–1.9 s (median 1.5) with this.
const RCVBUF: usize = 1 << 20;

/// What the monitor saw.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// Someone other than `ignore_portid` changed table `nftproxy` (either family).
    Foreign,
    /// Notifications were lost (receive buffer overflow): anything may have changed.
    Overflow,
}

pub struct Monitor {
    sock: Arc<Socket>,
    ignore_portid: u32,
    buf: Vec<u8>,
}

impl Monitor {
    /// Opens a socket in the calling thread's network namespace, subscribed to the
    /// notifications. Changes caused by the netlink socket with port id `ignore_portid` (the
    /// agent's own) are not reported.
    pub fn open(ignore_portid: u32) -> io::Result<Monitor> {
        let sock = subscribe(RCVBUF)?;
        Ok(Monitor {
            sock: Arc::new(sock),
            ignore_portid,
            buf: vec![0; 1 << 16],
        })
    }

    /// A handle for the sync to leave the notifications out of its own large transactions;
    /// `missed` is called when another commit may have gone unseen meanwhile.
    pub fn quieter(&self, missed: impl Fn() + Send + Sync + 'static) -> Quieter {
        Quieter {
            sock: self.sock.clone(),
            missed: Box::new(missed),
            pause: Mutex::default(),
        }
    }

    /// Blocks until a relevant notification arrives.
    pub fn wait(&mut self) -> io::Result<Event> {
        loop {
            self.buf.resize(1 << 16, 0);
            let n = match self.sock.recv(&mut &mut self.buf[..], 0) {
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => return Ok(Event::Overflow),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if foreign_change(&self.buf[..n], self.ignore_portid) {
                return Ok(Event::Foreign);
            }
        }
    }
}

/// For a reader that waits on several things, or with a timeout, before calling
/// [`Monitor::wait`] or [`Monitor::drain`].
impl AsRawFd for Monitor {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }
}

/// While anyone listens, nf_tables builds a notification for every object a transaction adds
/// or deletes, inside the committing `sendmsg`: a large transaction (a cold start, or the
/// repair after someone deleted the table) then takes markedly longer (1.5 to 2.6 times as
/// long at 30k Services in our measurements). The sync steps out
/// of the notification group around its own large transactions. When it steps back in, the
/// ruleset generation tells whether anyone else committed meanwhile: it must have moved on by
/// exactly the sync's own commits.
pub struct Quieter {
    sock: Arc<Socket>,
    missed: Box<dyn Fn() + Send + Sync>,
    /// The pause in progress, if any. Both families may commit at once (see
    /// `Syncer::sync_families`): the notifications stay off until the last of them resumes.
    pause: Mutex<Option<Pause>>,
}

struct Pause {
    /// Syncs paused now (at least one).
    syncs: usize,
    /// What the first of them saw before stepping out.
    generation: u32,
    commits: u64,
}

/// One sync's part in a pause, handed back to [`Quieter::resume`].
pub(crate) struct Paused(());

impl Quieter {
    /// Runs `commit` (which commits through `nft`) with the notifications paused, then
    /// reports any commit by someone else meanwhile. If the generation cannot be read, `commit`
    /// runs with the notifications on.
    pub fn around<T>(&self, nft: &mut Nftables, commit: impl FnOnce(&mut Nftables) -> T) -> T {
        let paused = self.pause(nft);
        let out = commit(nft);
        if let Some(paused) = paused {
            self.resume(nft, paused);
        }
        out
    }

    /// Stops the notifications; `None` (and nothing changed) if the generation cannot be read.
    pub(crate) fn pause(&self, nft: &mut Nftables) -> Option<Paused> {
        let mut pause = self.lock();
        match pause.as_mut() {
            Some(p) => p.syncs += 1,
            None => {
                // Read first: a commit after this either still reaches the monitor or is counted.
                let generation = nft.generation().ok()?;
                self.sock.drop_membership(NFNLGRP_NFTABLES).ok()?;
                *pause = Some(Pause {
                    syncs: 1,
                    generation,
                    commits: nft.commits(),
                });
            }
        }
        Some(Paused(()))
    }

    /// Ends a sync's part in the pause; the last one restarts the notifications and reports a
    /// commit by anyone else since the pause began (`nft`'s commit count is all of ours: the
    /// families share the connection).
    pub(crate) fn resume(&self, nft: &mut Nftables, _: Paused) {
        let mut pause = self.lock();
        if let Some(p) = pause.as_mut()
            && p.syncs > 1
        {
            p.syncs -= 1;
            return;
        }
        let Some(since) = pause.take() else {
            return;
        };
        if let Err(e) = self.sock.add_membership(NFNLGRP_NFTABLES) {
            tracing::warn!(error = %e, "cannot rejoin nftables change notifications");
            (self.missed)();
            return;
        }
        // Joined first: a commit after the read below reaches the monitor.
        let ours = nft.commits() - since.commits;
        match nft.generation() {
            Ok(now) if u64::from(now.wrapping_sub(since.generation)) == ours => {}
            _ => (self.missed)(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Pause>> {
        // A count and two numbers: nothing a panic could leave half-updated.
        self.pause.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Monitor {
    /// Discards the notifications queued so far (one change, such as `nft flush ruleset`,
    /// produces many; one repair covers them all) and says how many datagrams that was.
    pub fn drain(&mut self) -> usize {
        let mut drained = 0;
        loop {
            self.buf.resize(1 << 16, 0);
            match self.sock.recv(&mut &mut self.buf[..], libc::MSG_DONTWAIT) {
                Ok(_) => drained += 1,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return drained,
            }
        }
    }
}

/// Whether a datagram of notifications holds a change to table `nftproxy` not made by
/// `ignore_portid`.
#[doc(hidden)] // Public for the fuzz tests.
pub fn foreign_change(datagram: &[u8], ignore_portid: u32) -> bool {
    let mut off = 0;
    while off + NLMSG_HDRLEN <= datagram.len() {
        let h = &datagram[off..];
        let len = u32::from_ne_bytes([h[0], h[1], h[2], h[3]]) as usize;
        if len < NLMSG_HDRLEN || off + len > datagram.len() {
            return false;
        }
        let kind = u16::from_ne_bytes([h[4], h[5]]);
        let pid = u32::from_ne_bytes([h[12], h[13], h[14], h[15]]);
        let (subsys, msg) = (kind >> 8, kind & 0xff);
        if subsys == NFNL_SUBSYS_NFTABLES
            && msg != NFT_MSG_NEWGEN
            && msg != NFT_MSG_GETGEN
            && pid != ignore_portid
            && table_name(&h[NLMSG_HDRLEN..len]) == Some(TABLE.as_bytes())
        {
            return true;
        }
        off += (len + 3) & !3;
    }
    false
}

/// The table name attribute of an nf_tables message body (after the netlink header).
fn table_name(body: &[u8]) -> Option<&[u8]> {
    let mut off = NFGENMSG_LEN;
    while off + 4 <= body.len() {
        let len = u16::from_ne_bytes([body[off], body[off + 1]]) as usize;
        let kind = u16::from_ne_bytes([body[off + 2], body[off + 3]]) & 0x3fff;
        if len < 4 || off + len > body.len() {
            return None;
        }
        if kind == NFTA_TABLE_ATTR {
            let value = &body[off + 4..off + len];
            return Some(value.strip_suffix(&[0]).unwrap_or(value));
        }
        off += (len + 3) & !3;
    }
    None
}

/// A netlink socket in the calling thread's network namespace, with a receive buffer of
/// `rcvbuf` bytes (forced past the system limit where allowed), subscribed to nf_tables
/// change notifications.
pub fn subscribe(rcvbuf: usize) -> io::Result<Socket> {
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    let size = rcvbuf as libc::c_int;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: setsockopt with a pointer to a live c_int and its size.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            break;
        }
    }
    sock.add_membership(NFNLGRP_NFTABLES)?;
    Ok(sock)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(msg: u16, pid: u32, table: &str) -> Vec<u8> {
        let mut attr = Vec::new();
        let name = [table.as_bytes(), &[0]].concat();
        attr.extend(((4 + name.len()) as u16).to_ne_bytes());
        attr.extend(NFTA_TABLE_ATTR.to_ne_bytes());
        attr.extend(&name);
        while attr.len() % 4 != 0 {
            attr.push(0);
        }
        let len = NLMSG_HDRLEN + NFGENMSG_LEN + attr.len();
        let mut m = Vec::new();
        m.extend((len as u32).to_ne_bytes());
        m.extend(((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
        m.extend(0u16.to_ne_bytes());
        m.extend(0u32.to_ne_bytes());
        m.extend(pid.to_ne_bytes());
        m.extend([2, 0, 0, 0]);
        m.extend(attr);
        m
    }

    #[test]
    fn only_foreign_changes_to_our_table_count() {
        assert!(foreign_change(&message(2, 99, "nftproxy"), 7));
        assert!(!foreign_change(&message(2, 7, "nftproxy"), 7));
        assert!(!foreign_change(&message(2, 99, "filter"), 7));
        assert!(!foreign_change(&message(NFT_MSG_NEWGEN, 99, "nftproxy"), 7));
        let two = [message(6, 7, "nftproxy"), message(8, 5, "nftproxy")].concat();
        assert!(foreign_change(&two, 7));
        assert!(!foreign_change(&[1, 2, 3], 7));
    }
}
