//! The conntrack backend: lists and deletes connection-tracking entries over ctnetlink, for the
//! UDP cleanup after syncs (which entries go is decided by [`dataplane::conntrack`]).
//!
//! # Netns
//! Like [`crate::nftables::Nftables`], a [`Conntrack`] works in the network namespace of the
//! thread that opened it.
//!
//! # Listing
//! [`Conntrack::scan`] dumps one family's table (`IPCTNL_MSG_CT_GET` with `NLM_F_DUMP`), filtered
//! in the kernel to one L4 protocol where supported, and hands each entry to a callback, so a
//! large table is never held in memory; entries that cannot be decoded are skipped and counted.
//! A dump is not a snapshot: entries created or deleted meanwhile may be missed or seen twice.
//!
//! # Deleting
//! [`Conntrack::delete`] sends one `IPCTNL_MSG_CT_DELETE` per entry (original tuple, zone, and the
//! listed entry id, so that a newer entry that reuses the tuple survives), many messages per
//! `send()`. Only the last message of each send asks for an ACK; the kernel answers the others
//! only when they fail. ENOENT (the entry expired or was replaced meanwhile) is not a failure.

mod wire;

use std::io;
use std::os::fd::AsRawFd;

use dataplane::conntrack::{Frontends, Tuple, is_stale};
use dataplane::nft::ruleset::{Family, Proto};
use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

use self::wire::{CT_NEW, NLMSG_DONE, NLMSG_ERROR};
#[doc(hidden)]
pub use self::wire::{DecodedMessage, decode_datagram};

/// One conntrack entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Flow {
    /// The direction of the first packet, before NAT.
    pub orig: Tuple,
    /// The direction of replies: `reply.src` is where a DNATed flow really goes.
    pub reply: Tuple,
    /// Conntrack zone (0 by default).
    pub zone: u16,
    /// The kernel's id of the entry, when reported.
    pub id: Option<u32>,
}

/// What went wrong talking to ctnetlink.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("conntrack netlink {context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("conntrack dump failed: {source}")]
    Dump {
        errno: i32,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the conntrack replies: {0}")]
    Decode(String),
    /// Some deletions failed for another reason than the entry being gone already.
    #[error("{failed} of {requested} conntrack deletions failed ({deleted} deleted): {source}")]
    Delete {
        requested: usize,
        deleted: usize,
        failed: usize,
        /// The first errno.
        errno: i32,
        #[source]
        source: io::Error,
    },
}

impl ConntrackError {
    fn io(context: &'static str) -> impl FnOnce(io::Error) -> ConntrackError {
        move |source| ConntrackError::Io { context, source }
    }
}

/// What [`Conntrack::scan`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanStats {
    /// Entries handed to the callback.
    pub entries: usize,
    /// Entries skipped because they could not be decoded.
    pub undecodable: usize,
}

/// What [`Conntrack::clean_stale_udp`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CleanupStats {
    /// UDP entries of the family listed.
    pub listed: usize,
    /// Entries found stale.
    pub stale: usize,
    /// Stale entries deleted (the others vanished on their own meanwhile).
    pub deleted: usize,
}

/// Deletions per `send()`. Each message is under 100 bytes; the replies (errors only, and one
/// ACK) stay far below the receive buffer.
const DELETES_PER_SEND: usize = 512;
/// Largest datagram the kernel sends: dump parts are at most 32 KiB (64 KiB with big pages).
const RECV_BUF: usize = 128 << 10;
const RCVBUF: usize = 4 << 20;
/// Blocking reads give up after this long without any reply.
const RECV_TIMEOUT_SECS: libc::time_t = 30;

/// A ctnetlink connection in the network namespace of the thread that opened it.
pub struct Conntrack {
    sock: Socket,
    seq: u32,
    recv_buf: Vec<u8>,
    /// The kernel rejected the dump filter once: dump unfiltered from then on.
    no_filter: bool,
}

impl std::fmt::Debug for Conntrack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conntrack")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

fn setsockopt<T>(sock: &Socket, opt: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: plain setsockopt on a socket we own, with a pointer to a live value and its size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl Conntrack {
    /// Opens a `NETLINK_NETFILTER` socket in the calling thread's network namespace.
    pub fn open() -> Result<Conntrack, ConntrackError> {
        let mut sock = Socket::new(NETLINK_NETFILTER).map_err(ConntrackError::io("socket"))?;
        sock.bind_auto().map_err(ConntrackError::io("bind"))?;
        // Errors carry only the header of the failed request.
        sock.set_cap_ack(true)
            .map_err(ConntrackError::io("NETLINK_CAP_ACK"))?;
        let timeout = libc::timeval {
            tv_sec: RECV_TIMEOUT_SECS,
            tv_usec: 0,
        };
        setsockopt(&sock, libc::SO_RCVTIMEO, &timeout)
            .map_err(ConntrackError::io("SO_RCVTIMEO"))?;
        let rcvbuf = RCVBUF as libc::c_int;
        setsockopt(&sock, libc::SO_RCVBUFFORCE, &rcvbuf)
            .or_else(|_| setsockopt(&sock, libc::SO_RCVBUF, &rcvbuf))
            .map_err(ConntrackError::io("SO_RCVBUF"))?;
        Ok(Conntrack {
            sock,
            seq: 1,
            recv_buf: Vec::with_capacity(RECV_BUF),
            no_filter: false,
        })
    }

    fn next_seq(&mut self, n: usize) -> u32 {
        let first = self.seq;
        self.seq = self.seq.wrapping_add(n as u32);
        first
    }

    fn send(&self, buf: &[u8]) -> Result<(), ConntrackError> {
        loop {
            match self.sock.send(buf, 0) {
                Ok(n) if n == buf.len() => return Ok(()),
                Ok(n) => {
                    return Err(ConntrackError::Io {
                        context: "send",
                        source: io::Error::other(format!("short send: {n} of {}", buf.len())),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ConntrackError::io("send")(e)),
            }
        }
    }

    /// Receives one datagram; `Ok(None)` when `nonblocking` and nothing is queued.
    fn recv(&mut self, nonblocking: bool) -> io::Result<Option<&[u8]>> {
        self.recv_buf.clear();
        self.recv_buf.reserve(RECV_BUF);
        let flags = libc::MSG_TRUNC | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
        loop {
            match self.sock.recv(&mut self.recv_buf, flags) {
                Ok(n) if n > self.recv_buf.len() => {
                    return Err(io::Error::other(format!(
                        "netlink reply of {n} bytes exceeds the receive buffer"
                    )));
                }
                Ok(_) => return Ok(Some(&self.recv_buf)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if nonblocking && e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// Dumps the entries of `family` (only protocol `proto`, if given) into `each`.
    pub fn scan(
        &mut self,
        family: Family,
        proto: Option<u8>,
        mut each: impl FnMut(Flow),
    ) -> Result<ScanStats, ConntrackError> {
        let filter = proto.filter(|_| !self.no_filter);
        match self.scan_once(family, proto, filter, &mut each) {
            // A kernel that knows CTA_FILTER but not this use of it.
            Err(ConntrackError::Dump { errno, .. })
                if filter.is_some() && (errno == libc::EOPNOTSUPP || errno == libc::EINVAL) =>
            {
                tracing::debug!(errno, "conntrack dump filter rejected, dumping unfiltered");
                self.no_filter = true;
                self.scan_once(family, proto, None, &mut each)
            }
            r => r,
        }
    }

    fn scan_once(
        &mut self,
        family: Family,
        proto: Option<u8>,
        filter: Option<u8>,
        each: &mut impl FnMut(Flow),
    ) -> Result<ScanStats, ConntrackError> {
        let seq = self.next_seq(1);
        let mut buf = Vec::new();
        wire::dump_request(&mut buf, family, filter, seq);
        self.send(&buf)?;
        let mut stats = ScanStats::default();
        loop {
            let datagram = self
                .recv(false)
                .map_err(ConntrackError::io("reading the dump"))?
                .unwrap_or_default();
            let msgs = wire::messages(datagram).map_err(ConntrackError::Decode)?;
            for m in msgs {
                if m.seq != seq {
                    continue; // A late reply to an earlier request.
                }
                match m.kind {
                    NLMSG_DONE | NLMSG_ERROR => {
                        let errno = m.code();
                        if errno != 0 {
                            return Err(ConntrackError::Dump {
                                errno,
                                source: io::Error::from_raw_os_error(errno),
                            });
                        }
                        if m.kind == NLMSG_DONE {
                            return Ok(stats);
                        }
                    }
                    CT_NEW => match wire::decode_flow(&m) {
                        Ok(flow) => {
                            // Older kernels ignore the filter.
                            let family_ok = Family::of(&flow.orig.src) == family;
                            if family_ok && proto.is_none_or(|p| p == flow.orig.proto) {
                                stats.entries += 1;
                                each(flow);
                            }
                        }
                        Err(reason) => {
                            if stats.undecodable == 0 {
                                tracing::debug!(%reason, "skipping a conntrack entry");
                            }
                            stats.undecodable += 1;
                        }
                    },
                    _ => {}
                }
            }
        }
    }

    /// Whether dumps are filtered by protocol in the kernel: false once the kernel rejected the
    /// filter (then entries are filtered here).
    pub fn kernel_filters(&self) -> bool {
        !self.no_filter
    }

    /// All entries of `family` with protocol `proto` (all protocols if `None`).
    pub fn list(&mut self, family: Family, proto: Option<u8>) -> Result<Vec<Flow>, ConntrackError> {
        let mut out = Vec::new();
        self.scan(family, proto, |f| out.push(f))?;
        Ok(out)
    }

    /// All UDP entries of `family`.
    pub fn list_udp(&mut self, family: Family) -> Result<Vec<Flow>, ConntrackError> {
        self.list(family, Some(Proto::Udp.number()))
    }

    /// Deletes `flows`; returns how many the kernel deleted. Entries that are gone already
    /// (expired, deleted, or replaced by a newer entry with the same tuple) are not counted and
    /// not an error. Only protocols with ports (TCP, UDP, SCTP, ...) can be deleted this way.
    pub fn delete(&mut self, flows: &[Flow]) -> Result<usize, ConntrackError> {
        let (mut deleted, mut failed, mut first_errno) = (0, 0, 0);
        for chunk in flows.chunks(DELETES_PER_SEND) {
            let first = self.next_seq(chunk.len());
            let last = first.wrapping_add(chunk.len() as u32 - 1);
            let mut buf = Vec::with_capacity(chunk.len() * 96);
            for (i, flow) in chunk.iter().enumerate() {
                let seq = first.wrapping_add(i as u32);
                wire::delete_request(&mut buf, flow, seq == last, seq);
            }
            self.send(&buf)?;
            let errors = self.delete_replies(first, last)?;
            let mut gone = 0;
            for errno in errors {
                if errno == libc::ENOENT {
                    gone += 1;
                } else {
                    failed += 1;
                    if first_errno == 0 {
                        first_errno = errno;
                    }
                }
            }
            deleted += chunk.len().saturating_sub(gone + failed);
        }
        if failed > 0 {
            return Err(ConntrackError::Delete {
                requested: flows.len(),
                deleted,
                failed,
                errno: first_errno,
                source: io::Error::from_raw_os_error(first_errno),
            });
        }
        Ok(deleted)
    }

    /// The errnos of the failed messages `first..=last` of a delete chunk.
    fn delete_replies(&mut self, first: u32, last: u32) -> Result<Vec<i32>, ConntrackError> {
        let span = last.wrapping_sub(first);
        let mut errors = Vec::new();
        let mut done = false;
        let mut overrun = false;
        // The kernel handles the messages inside send(): the replies are queued already. Read
        // without blocking; block only if, against expectations, the last reply is missing.
        let mut nonblocking = true;
        loop {
            let datagram = match self.recv(nonblocking) {
                Ok(Some(d)) => d,
                Ok(None) if done || overrun => break,
                Ok(None) => {
                    nonblocking = false;
                    continue;
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    // Error replies were dropped: the count is a lower bound.
                    overrun = true;
                    nonblocking = true;
                    continue;
                }
                Err(e) => return Err(ConntrackError::io("reading the delete replies")(e)),
            };
            let msgs = wire::messages(datagram).map_err(ConntrackError::Decode)?;
            for m in msgs {
                if m.kind != NLMSG_ERROR || m.seq.wrapping_sub(first) > span {
                    continue;
                }
                let errno = m.code();
                if errno != 0 {
                    errors.push(errno);
                }
                if m.seq == last {
                    done = true;
                    nonblocking = true;
                }
            }
        }
        if overrun {
            tracing::debug!(
                reported = errors.len(),
                "conntrack delete replies were dropped; counts are approximate"
            );
        }
        Ok(errors)
    }

    /// Deletes the UDP entries of `family` that `current` (and `previous`, the frontends of the
    /// sync before) make stale, see [`dataplane::conntrack::is_stale`].
    pub fn clean_stale_udp(
        &mut self,
        family: Family,
        current: &Frontends,
        previous: &Frontends,
    ) -> Result<CleanupStats, ConntrackError> {
        let mut stale = Vec::new();
        let scan = self.scan(family, Some(Proto::Udp.number()), |f| {
            if is_stale(&f.orig, &f.reply, current, previous) {
                stale.push(f);
            }
        })?;
        let deleted = self.delete(&stale)?;
        Ok(CleanupStats {
            listed: scan.entries,
            stale: stale.len(),
            deleted,
        })
    }
}
