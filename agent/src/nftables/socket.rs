//! The `NETLINK_NETFILTER` socket: buffer sizing, sending a batch, reading replies.
//!
//! A batch must reach the kernel in a single `send()`: nfnetlink processes one socket buffer at
//! a time, and a buffer that ends before `NFNL_MSG_BATCH_END` is validated and aborted, not
//! continued by the next one. (Checked on 6.18: `BEGIN, NEWTABLE` in one send and `END` in the
//! next acknowledges the NEWTABLE with 0, answers the lone END with EINVAL, and creates no
//! table.) So the send buffer is raised to the size of the batch (`SO_SNDBUFFORCE`, which needs
//! CAP_NET_ADMIN — which programming nftables needs anyway — falling back to `SO_SNDBUF`).
//!
//! The kernel handles a batch synchronously inside `send()`, so when `send()` returns every
//! reply is already queued on the socket (or was dropped for lack of receive buffer, which the
//! next `recv()` reports as `ENOBUFS`).

use std::io;
use std::os::fd::AsRawFd;

use super::monitor::NFNLGRP_NFTABLES;
use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};

/// Netlink message types of the control messages we read.
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;

/// Kernel memory charged per queued reply (the `truesize` of a small skb is well below this).
const RCVBUF_PER_REPLY: usize = 1024;
const MIN_RCVBUF: usize = 4 << 20;
const MAX_RCVBUF: usize = 256 << 20;
/// Largest datagram the kernel sends us: dump replies are at most 32 KiB, errors carry at most
/// the (64 KiB-bounded) request they refer to.
const RECV_BUF: usize = 128 << 10;
/// Blocking reads (dumps) give up after this long without any reply.
const RECV_TIMEOUT_SECS: libc::time_t = 30;

/// One netlink message inside a received datagram.
pub(super) struct RawMessage<'a> {
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    /// The whole message, header included.
    pub bytes: &'a [u8],
}

impl RawMessage<'_> {
    /// The errno of an `NLMSG_ERROR` (0 for an ACK), as a positive number.
    pub fn error_code(&self) -> Option<i32> {
        if self.kind != NLMSG_ERROR || self.bytes.len() < NLMSG_HDRLEN + 4 {
            return None;
        }
        let raw = i32::from_ne_bytes(
            self.bytes[NLMSG_HDRLEN..NLMSG_HDRLEN + 4]
                .try_into()
                .expect("4 bytes"),
        );
        // Wrapping: `i32::MIN` from a broken reply must not panic.
        Some(raw.wrapping_neg())
    }

    /// The status of an `NLMSG_DONE` (a dump that failed part-way reports a negative errno).
    pub fn done_code(&self) -> i32 {
        if self.bytes.len() < NLMSG_HDRLEN + 4 {
            return 0;
        }
        let raw = i32::from_ne_bytes(
            self.bytes[NLMSG_HDRLEN..NLMSG_HDRLEN + 4]
                .try_into()
                .expect("4 bytes"),
        );
        raw.wrapping_neg()
    }
}

/// Splits a datagram into netlink messages.
pub(super) fn messages(datagram: &[u8]) -> Result<Vec<RawMessage<'_>>, String> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + NLMSG_HDRLEN <= datagram.len() {
        let h = &datagram[off..];
        let len = u32::from_ne_bytes(h[0..4].try_into().expect("4 bytes")) as usize;
        if len < NLMSG_HDRLEN || off + len > datagram.len() {
            return Err(format!(
                "truncated netlink message ({len} bytes at offset {off} of {})",
                datagram.len()
            ));
        }
        out.push(RawMessage {
            kind: u16::from_ne_bytes(h[4..6].try_into().expect("2 bytes")),
            flags: u16::from_ne_bytes(h[6..8].try_into().expect("2 bytes")),
            seq: u32::from_ne_bytes(h[8..12].try_into().expect("4 bytes")),
            bytes: &h[..len],
        });
        // Messages are 4-byte aligned (NLMSG_ALIGN).
        off += (len + 3) & !3;
    }
    Ok(out)
}

/// What the reply readers take from a datagram: each message's type, flags, sequence number,
/// error code and done code. Public (hidden) for the fuzz tests.
#[doc(hidden)]
pub fn datagram_replies(datagram: &[u8]) -> Result<Vec<ReplyFields>, String> {
    Ok(messages(datagram)?
        .iter()
        .map(|m| (m.kind, m.flags, m.seq, m.error_code(), m.done_code()))
        .collect())
}

/// A message of [`datagram_replies`]: type, flags, sequence number, error code, done code.
pub type ReplyFields = (u16, u16, u32, Option<i32>, i32);

pub(super) struct NlSocket {
    sock: Socket,
    /// The netlink port id the kernel gave this socket; nf_tables change notifications carry
    /// the port id of the socket that caused them.
    portid: u32,
    sndbuf: usize,
    rcvbuf: usize,
    recv_buf: Vec<u8>,
}

fn setsockopt_int(
    sock: &Socket,
    level: libc::c_int,
    opt: libc::c_int,
    value: usize,
) -> io::Result<()> {
    let v = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
    // SAFETY: plain setsockopt on a socket we own, with a pointer to a live c_int and its size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Sets a socket buffer size, forcing it past the sysctl limits when allowed.
fn set_buffer(
    sock: &Socket,
    force: libc::c_int,
    plain: libc::c_int,
    size: usize,
) -> io::Result<()> {
    setsockopt_int(sock, libc::SOL_SOCKET, force, size)
        .or_else(|_| setsockopt_int(sock, libc::SOL_SOCKET, plain, size))
}

impl NlSocket {
    pub fn open() -> io::Result<NlSocket> {
        let mut sock = Socket::new(NETLINK_NETFILTER)?;
        let addr = sock.bind_auto()?;
        // Errors then carry only the header of the failed request, not the request itself:
        // a failing 100k-message batch can answer with many errors.
        sock.set_cap_ack(true)?;
        let timeout = libc::timeval {
            tv_sec: RECV_TIMEOUT_SECS,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a pointer to a live timeval and its size.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut s = NlSocket {
            portid: addr.port_number(),
            sock,
            sndbuf: 0,
            rcvbuf: 0,
            recv_buf: Vec::with_capacity(RECV_BUF),
        };
        s.ensure_buffers(0, 0)?;
        Ok(s)
    }

    pub fn portid(&self) -> u32 {
        self.portid
    }

    /// Makes room for sending `send_len` bytes at once and for `replies` queued replies.
    pub fn ensure_buffers(&mut self, send_len: usize, replies: usize) -> io::Result<()> {
        // The kernel doubles the value and wants the message below `sk_sndbuf - 32`.
        let want_snd = send_len.max(1 << 20);
        if want_snd > self.sndbuf {
            set_buffer(&self.sock, libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, want_snd)?;
            self.sndbuf = want_snd;
        }
        let want_rcv = (replies * RCVBUF_PER_REPLY).clamp(MIN_RCVBUF, MAX_RCVBUF);
        if want_rcv > self.rcvbuf {
            set_buffer(&self.sock, libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, want_rcv)?;
            self.rcvbuf = want_rcv;
        }
        Ok(())
    }

    /// Sends `buf` as one datagram to the kernel.
    pub fn send(&self, buf: &[u8]) -> io::Result<()> {
        let sent = self.sock.send(buf, 0)?;
        if sent != buf.len() {
            return Err(io::Error::other(format!(
                "short netlink send: {sent} of {} bytes",
                buf.len()
            )));
        }
        Ok(())
    }

    /// Receives one datagram. `Ok(None)` when `nonblocking` and nothing is queued.
    pub fn recv(&mut self, nonblocking: bool) -> io::Result<Option<&[u8]>> {
        self.recv_buf.clear();
        self.recv_buf.reserve(RECV_BUF);
        let flags = libc::MSG_TRUNC | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
        loop {
            match self.sock.recv(&mut self.recv_buf, flags) {
                Ok(n) if n > self.recv_buf.len() => {
                    return Err(io::Error::other(format!(
                        "netlink reply of {n} bytes exceeds the {RECV_BUF}-byte receive buffer"
                    )));
                }
                Ok(_) => return Ok(Some(&self.recv_buf)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if nonblocking && e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }
}

/// Room for the notifications of other programs' commits during one read of our table. A
/// commit larger than this (thousands of objects) overflows it, which only costs a retry.
const NOTIFY_RCVBUF: usize = 4 << 20;

/// A socket for nf_tables change notifications, subscribed only during a read (see
/// `dump::read_table`): it tells which commits made meanwhile touched which tables. It is
/// opened with the [`super::Nftables`] handle, so it belongs to the same network namespace
/// whichever thread reads.
pub(super) struct Notifications {
    sock: Socket,
    buf: Vec<u8>,
}

impl Notifications {
    pub fn open() -> io::Result<Notifications> {
        let mut sock = Socket::new(NETLINK_NETFILTER)?;
        sock.bind_auto()?;
        set_buffer(&sock, libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, NOTIFY_RCVBUF)?;
        Ok(Notifications {
            sock,
            buf: vec![0; RECV_BUF],
        })
    }

    /// Subscribes, dropping whatever an earlier subscription left queued.
    pub fn join(&mut self) -> io::Result<()> {
        self.sock.add_membership(NFNLGRP_NFTABLES)?;
        loop {
            match self.recv(std::time::Duration::ZERO) {
                Ok(Some(_)) => {}
                Ok(None) => return Ok(()),
                // A stale overflow: gone once reported.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Unsubscribes (nothing is queued for us, and nobody's commits build notifications for
    /// us, between reads).
    pub fn leave(&mut self) {
        let _ = self.sock.drop_membership(NFNLGRP_NFTABLES);
    }

    /// Receives one datagram of notifications, waiting at most `wait`; `Ok(None)` if none
    /// came. `ENOBUFS` means notifications were lost.
    pub fn recv(&mut self, wait: std::time::Duration) -> io::Result<Option<&[u8]>> {
        loop {
            if !wait.is_zero() {
                let mut pfd = libc::pollfd {
                    fd: self.sock.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ms = wait.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
                // SAFETY: poll on one live pollfd.
                let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
                if rc < 0 {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(e);
                }
                if rc == 0 {
                    return Ok(None);
                }
            }
            match self
                .sock
                .recv(&mut &mut self.buf[..], libc::MSG_DONTWAIT | libc::MSG_TRUNC)
            {
                Ok(n) if n > self.buf.len() => {
                    return Err(io::Error::other(format!(
                        "notification of {n} bytes exceeds the {RECV_BUF}-byte buffer"
                    )));
                }
                Ok(n) => return Ok(Some(&self.buf[..n])),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }
}
