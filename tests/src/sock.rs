//! A thin libc socket wrapper for what `std::net` cannot do: binding a source address
//! before connecting, v6-only listeners, raw sockets, IP(V6)_PKTINFO and ICMP error queues.

use std::io;
use std::mem;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cvt_len(r: isize) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Converts a socket address to its C representation.
pub fn to_sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr type.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_scope_id = a.scope_id();
            mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Converts a C socket address back; `None` for families other than IPv4/IPv6.
pub fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in.
            let sin = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// The address family constant for an IP address.
pub fn family(ip: IpAddr) -> libc::c_int {
    if ip.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    }
}

/// An ICMP error taken from a socket's error queue (`IP_RECVERR`/`IPV6_RECVERR`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueuedError {
    pub errno: i32,
    /// `SO_EE_ORIGIN_ICMP` (2) or `SO_EE_ORIGIN_ICMP6` (3) for ICMP errors.
    pub origin: u8,
    pub icmp_type: u8,
    pub icmp_code: u8,
    /// Leading bytes of the offending packet's transport payload (for raw sockets).
    pub payload: Vec<u8>,
}

impl QueuedError {
    /// Whether this is an ICMP(v6) "port unreachable", which is what nftables `reject`
    /// sends by default and what a UDP socket reports as ECONNREFUSED.
    pub fn is_port_unreachable(&self) -> bool {
        matches!(
            (self.origin, self.icmp_type, self.icmp_code),
            (2, 3, 3) | (3, 1, 4)
        )
    }
}

/// A socket (close on drop).
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

impl Socket {
    /// `socket(family, ty | SOCK_CLOEXEC, proto)`.
    pub fn new(family: libc::c_int, ty: libc::c_int, proto: libc::c_int) -> io::Result<Socket> {
        // SAFETY: plain syscall; the returned descriptor is owned by us.
        let fd = cvt(unsafe { libc::socket(family, ty | libc::SOCK_CLOEXEC, proto) })?;
        // SAFETY: fd is a fresh, valid descriptor.
        Ok(Socket {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    fn raw(&self) -> libc::c_int {
        self.fd.as_raw_fd()
    }

    /// `setsockopt` with an integer value.
    pub fn set_int(
        &self,
        level: libc::c_int,
        name: libc::c_int,
        value: libc::c_int,
    ) -> io::Result<()> {
        // SAFETY: the pointer and length describe `value`.
        cvt(unsafe {
            libc::setsockopt(
                self.raw(),
                level,
                name,
                &value as *const _ as *const libc::c_void,
                mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        })
        .map(drop)
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        // SAFETY: fcntl on a descriptor we own.
        let flags = cvt(unsafe { libc::fcntl(self.raw(), libc::F_GETFL) })?;
        let flags = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        // SAFETY: as above.
        cvt(unsafe { libc::fcntl(self.raw(), libc::F_SETFL, flags) }).map(drop)
    }

    pub fn bind(&self, addr: &SocketAddr) -> io::Result<()> {
        let (ss, len) = to_sockaddr(addr);
        // SAFETY: ss/len describe a valid sockaddr.
        cvt(unsafe { libc::bind(self.raw(), &ss as *const _ as *const libc::sockaddr, len) })
            .map(drop)
    }

    /// A blocking `connect` (for datagram sockets).
    pub fn connect(&self, addr: &SocketAddr) -> io::Result<()> {
        let (ss, len) = to_sockaddr(addr);
        // SAFETY: ss/len describe a valid sockaddr.
        cvt(unsafe { libc::connect(self.raw(), &ss as *const _ as *const libc::sockaddr, len) })
            .map(drop)
    }

    /// `SO_ERROR`: the pending socket error (0 if none), clearing it.
    pub fn take_error(&self) -> io::Result<i32> {
        let mut err: libc::c_int = 0;
        let mut len = mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: pointer and length describe `err`.
        cvt(unsafe {
            libc::getsockopt(
                self.raw(),
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                &mut err as *mut _ as *mut libc::c_void,
                &mut len,
            )
        })?;
        Ok(err)
    }

    pub fn listen(&self, backlog: libc::c_int) -> io::Result<()> {
        // SAFETY: plain syscall.
        cvt(unsafe { libc::listen(self.raw(), backlog) }).map(drop)
    }

    pub fn accept(&self) -> io::Result<(Socket, SocketAddr)> {
        // SAFETY: zeroed sockaddr_storage is valid; the kernel fills it up to `len`.
        let mut ss: libc::sockaddr_storage = unsafe { mem::zeroed() };
        let mut len = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: ss/len describe writable storage.
        let fd = cvt(unsafe {
            libc::accept4(
                self.raw(),
                &mut ss as *mut _ as *mut libc::sockaddr,
                &mut len,
                libc::SOCK_CLOEXEC,
            )
        })?;
        // SAFETY: fd is a fresh, valid descriptor.
        let sock = Socket {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        };
        let peer = from_sockaddr(&ss).ok_or_else(|| io::Error::other("non-IP peer"))?;
        Ok((sock, peer))
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        // SAFETY: as in accept.
        let mut ss: libc::sockaddr_storage = unsafe { mem::zeroed() };
        let mut len = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: ss/len describe writable storage.
        cvt(unsafe {
            libc::getsockname(
                self.raw(),
                &mut ss as *mut _ as *mut libc::sockaddr,
                &mut len,
            )
        })?;
        from_sockaddr(&ss).ok_or_else(|| io::Error::other("non-IP address"))
    }

    pub fn send(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for reads of its length.
        cvt_len(unsafe {
            libc::send(
                self.raw(),
                buf.as_ptr() as *const libc::c_void,
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        })
    }

    pub fn send_to(&self, buf: &[u8], dst: &SocketAddr) -> io::Result<usize> {
        let (ss, len) = to_sockaddr(dst);
        // SAFETY: buf and ss are valid for their lengths.
        cvt_len(unsafe {
            libc::sendto(
                self.raw(),
                buf.as_ptr() as *const libc::c_void,
                buf.len(),
                libc::MSG_NOSIGNAL,
                &ss as *const _ as *const libc::sockaddr,
                len,
            )
        })
    }

    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: buf is valid for writes of its length.
        cvt_len(unsafe {
            libc::recv(
                self.raw(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
            )
        })
    }

    /// Waits for `events`; returns the `revents` (0 on timeout, `None` = wait forever).
    pub fn poll(
        &self,
        events: libc::c_short,
        timeout: Option<Duration>,
    ) -> io::Result<libc::c_short> {
        let mut pfd = libc::pollfd {
            fd: self.raw(),
            events,
            revents: 0,
        };
        let ms = timeout.map_or(-1, |t| {
            t.as_millis().clamp(0, i32::MAX as u128) as libc::c_int
        });
        loop {
            // SAFETY: one valid pollfd.
            match cvt(unsafe { libc::poll(&mut pfd, 1, ms) }) {
                Ok(0) => return Ok(0),
                Ok(_) => return Ok(pfd.revents),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// `recvmsg` returning the length, the peer and the local (destination) address from an
    /// `IP_PKTINFO`/`IPV6_PKTINFO` control message, when enabled on the socket.
    pub fn recv_pktinfo(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, Option<IpAddr>)> {
        // SAFETY: zeroed storage is valid.
        let mut ss: libc::sockaddr_storage = unsafe { mem::zeroed() };
        let mut control = [0u64; 32];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: zeroed msghdr is valid; fields set below.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_name = &mut ss as *mut _ as *mut libc::c_void;
        msg.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = mem::size_of_val(&control);
        // SAFETY: msg points to valid buffers that outlive the call.
        let n = cvt_len(unsafe { libc::recvmsg(self.raw(), &mut msg, 0) })?;
        let peer = from_sockaddr(&ss).ok_or_else(|| io::Error::other("non-IP peer"))?;
        let mut local = None;
        // SAFETY: iterating the control messages the kernel wrote, within msg_controllen.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                let data = libc::CMSG_DATA(cmsg);
                match ((*cmsg).cmsg_level, (*cmsg).cmsg_type) {
                    (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                        let info = std::ptr::read_unaligned(data as *const libc::in_pktinfo);
                        local = Some(IpAddr::V4(Ipv4Addr::from(
                            info.ipi_addr.s_addr.to_ne_bytes(),
                        )));
                    }
                    (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                        let info = std::ptr::read_unaligned(data as *const libc::in6_pktinfo);
                        local = Some(IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr)));
                    }
                    _ => {}
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok((n, peer, local))
    }

    /// `sendmsg` to `dst` with the source address forced to `src` via a PKTINFO control
    /// message (works for UDP and raw sockets bound to the wildcard address).
    pub fn send_from(&self, buf: &[u8], dst: &SocketAddr, src: IpAddr) -> io::Result<usize> {
        let (ss, sslen) = to_sockaddr(dst);
        let mut control = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: buf.as_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: zeroed msghdr is valid; fields set below.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_name = &ss as *const _ as *mut libc::c_void;
        msg.msg_namelen = sslen;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        // SAFETY: CMSG_* compute sizes/pointers inside `control`, which is large and aligned
        // enough for one pktinfo message; everything outlives the sendmsg call.
        unsafe {
            let (level, kind, len) = match src {
                IpAddr::V4(_) => (
                    libc::IPPROTO_IP,
                    libc::IP_PKTINFO,
                    mem::size_of::<libc::in_pktinfo>(),
                ),
                IpAddr::V6(_) => (
                    libc::IPPROTO_IPV6,
                    libc::IPV6_PKTINFO,
                    mem::size_of::<libc::in6_pktinfo>(),
                ),
            };
            msg.msg_controllen = libc::CMSG_SPACE(len as u32) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = level;
            (*cmsg).cmsg_type = kind;
            (*cmsg).cmsg_len = libc::CMSG_LEN(len as u32) as usize;
            let data = libc::CMSG_DATA(cmsg);
            match src {
                IpAddr::V4(ip) => {
                    let info = libc::in_pktinfo {
                        ipi_ifindex: 0,
                        ipi_spec_dst: libc::in_addr {
                            s_addr: u32::from_ne_bytes(ip.octets()),
                        },
                        ipi_addr: libc::in_addr { s_addr: 0 },
                    };
                    std::ptr::write_unaligned(data as *mut libc::in_pktinfo, info);
                }
                IpAddr::V6(ip) => {
                    let info = libc::in6_pktinfo {
                        ipi6_addr: libc::in6_addr {
                            s6_addr: ip.octets(),
                        },
                        ipi6_ifindex: 0,
                    };
                    std::ptr::write_unaligned(data as *mut libc::in6_pktinfo, info);
                }
            }
        }
        // SAFETY: msg points to valid buffers that outlive the call.
        cvt_len(unsafe { libc::sendmsg(self.raw(), &msg, libc::MSG_NOSIGNAL) })
    }

    /// Reads one entry of the error queue (needs `IP_RECVERR`/`IPV6_RECVERR`), if any.
    pub fn recv_error(&self) -> io::Result<Option<QueuedError>> {
        let mut buf = [0u8; 512];
        let mut control = [0u64; 64];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: zeroed msghdr is valid; fields set below.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = mem::size_of_val(&control);
        // SAFETY: msg points to valid buffers that outlive the call.
        let n = match cvt_len(unsafe {
            libc::recvmsg(
                self.raw(),
                &mut msg,
                libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT,
            )
        }) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        };
        // SAFETY: iterating the control messages the kernel wrote, within msg_controllen.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                let level = (*cmsg).cmsg_level;
                let kind = (*cmsg).cmsg_type;
                if (level == libc::IPPROTO_IP && kind == libc::IP_RECVERR)
                    || (level == libc::IPPROTO_IPV6 && kind == libc::IPV6_RECVERR)
                {
                    let ee = std::ptr::read_unaligned(
                        libc::CMSG_DATA(cmsg) as *const libc::sock_extended_err
                    );
                    return Ok(Some(QueuedError {
                        errno: ee.ee_errno as i32,
                        origin: ee.ee_origin,
                        icmp_type: ee.ee_type,
                        icmp_code: ee.ee_code,
                        payload: buf[..n.min(buf.len())].to_vec(),
                    }));
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok(None)
    }
}

/// The source address the kernel would pick to reach `dst` from the current namespace
/// (via a connected UDP socket; sends nothing).
pub fn route_source(dst: IpAddr) -> io::Result<IpAddr> {
    let s = Socket::new(family(dst), libc::SOCK_DGRAM, 0)?;
    s.connect(&SocketAddr::new(dst, 9))?;
    Ok(s.local_addr()?.ip())
}

/// Random bytes from the kernel.
pub fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: b is valid for writes of 4 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, 4, 0) };
    assert_eq!(n, 4, "getrandom failed");
    u32::from_ne_bytes(b)
}

/// Human-readable errno name for the common network errors (else the OS message).
pub fn error_name(e: &io::Error) -> String {
    let name = match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => "ECONNREFUSED",
        Some(libc::ECONNRESET) => "ECONNRESET",
        Some(libc::EHOSTUNREACH) => "EHOSTUNREACH",
        Some(libc::ENETUNREACH) => "ENETUNREACH",
        Some(libc::EADDRNOTAVAIL) => "EADDRNOTAVAIL",
        Some(libc::EACCES) => "EACCES",
        Some(libc::EPERM) => "EPERM",
        Some(libc::EPROTO) => "EPROTO",
        _ => return e.to_string(),
    };
    name.to_string()
}
