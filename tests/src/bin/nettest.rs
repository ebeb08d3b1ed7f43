//! `nettest`: the echo server and prober the namespace harness runs inside namespaces.
//!
//! ```text
//! nettest echo --ports 80,8443 [--no-sctp]
//!     TCP and UDP listeners on every port (0.0.0.0 and [::], IPv6-only), plus a raw SCTP
//!     responder. Each answers with "nettest <local addr:port> <peer addr:port>": TCP writes
//!     it and closes, UDP replies from the address the datagram was sent to (IP_PKTINFO),
//!     SCTP answers an INIT with an ABORT carrying it as the abort reason (an INIT to any
//!     other port gets a bare ABORT: refused). Prints JSON events on stdout, first
//!     {"event":"ready"} once everything listens.
//!
//! nettest probe --proto tcp|udp|sctp --dst ADDR:PORT [--count N] [--src IP]
//!               [--timeout-ms MS] [--parallel K] [--sport PORT]
//!     N attempts, each from a fresh socket (a new source port), at most K at a time;
//!     prints one JSON `Attempt` per line. With --sport (TCP, UDP), every attempt binds that
//!     source port and they run one after the other: the same flow each time.
//! ```

use std::collections::BTreeSet;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nftproxy_tests::probe::{Attempt, Proto, format_report, parse_report};
use nftproxy_tests::sctp::{self, Packet};
use nftproxy_tests::sock::{self, Socket, error_name, family};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("echo") => echo(&Opts::parse(&args[1..])),
        Some("probe") => probe(&Opts::parse(&args[1..])),
        _ => Err(anyhow::anyhow!(
            "usage: nettest echo|probe [options] (see the source)"
        )),
    };
    if let Err(e) = result {
        eprintln!("nettest: {e:#}");
        std::process::exit(2);
    }
}

/// `--key value` pairs and bare `--flag`s.
struct Opts(Vec<(String, Option<String>)>);

impl Opts {
    fn parse(args: &[String]) -> Opts {
        let mut out = Vec::new();
        let mut it = args.iter().peekable();
        while let Some(a) = it.next() {
            let value = match it.peek() {
                Some(v) if !v.starts_with("--") => it.next().cloned(),
                _ => None,
            };
            out.push((a.trim_start_matches('-').to_string(), value));
        }
        Opts(out)
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.as_deref())
    }

    fn flag(&self, key: &str) -> bool {
        self.0.iter().any(|(k, _)| k == key)
    }

    fn parsed<T: std::str::FromStr>(&self, key: &str, default: Option<T>) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        match (self.get(key), default) {
            (Some(v), _) => v.parse().map_err(|e| anyhow::anyhow!("--{key} {v:?}: {e}")),
            (None, Some(d)) => Ok(d),
            (None, None) => bail!("--{key} is required"),
        }
    }
}

fn event(value: serde_json::Value) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

fn wildcard(v6: bool, port: u16) -> SocketAddr {
    if v6 {
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port)
    } else {
        SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port)
    }
}

fn echo(opts: &Opts) -> Result<()> {
    let ports: Vec<u16> = opts
        .get("ports")
        .context("--ports is required")?
        .split(',')
        .map(|p| p.trim().parse().with_context(|| format!("bad port {p:?}")))
        .collect::<Result<_>>()?;
    let mut sockets: Vec<(&str, Socket)> = Vec::new();
    for v6 in [false, true] {
        let fam = if v6 { libc::AF_INET6 } else { libc::AF_INET };
        for &port in &ports {
            let tcp = Socket::new(fam, libc::SOCK_STREAM, 0)?;
            tcp.set_int(libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
            let udp = Socket::new(fam, libc::SOCK_DGRAM, 0)?;
            if v6 {
                tcp.set_int(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
                udp.set_int(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
                udp.set_int(libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1)?;
            } else {
                udp.set_int(libc::IPPROTO_IP, libc::IP_PKTINFO, 1)?;
            }
            tcp.bind(&wildcard(v6, port))
                .with_context(|| format!("tcp bind {}", wildcard(v6, port)))?;
            tcp.listen(1024)?;
            udp.bind(&wildcard(v6, port))
                .with_context(|| format!("udp bind {}", wildcard(v6, port)))?;
            sockets.push(("tcp", tcp));
            sockets.push(("udp", udp));
        }
        if !opts.flag("no-sctp") {
            let raw =
                Socket::new(fam, libc::SOCK_RAW, libc::IPPROTO_SCTP).context("raw SCTP socket")?;
            if v6 {
                raw.set_int(libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1)?;
            } else {
                raw.set_int(libc::IPPROTO_IP, libc::IP_PKTINFO, 1)?;
            }
            sockets.push(("sctp", raw));
        }
    }
    let ports: BTreeSet<u16> = ports.into_iter().collect();
    std::thread::scope(|s| {
        for (kind, sock) in &sockets {
            let ports = &ports;
            s.spawn(move || {
                let r = match *kind {
                    "tcp" => tcp_echo(sock),
                    "udp" => udp_echo(sock),
                    _ => sctp_echo(sock, ports),
                };
                if let Err(e) = r {
                    event(
                        serde_json::json!({"event": "error", "kind": kind, "error": e.to_string()}),
                    );
                }
            });
        }
        event(serde_json::json!({"event": "ready"}));
    });
    Ok(())
}

fn tcp_echo(listener: &Socket) -> io::Result<()> {
    loop {
        let (conn, peer) = listener.accept()?;
        let local = conn.local_addr()?;
        let _ = conn.send(format!("{}\n", format_report(local, peer)).as_bytes());
        event(serde_json::json!({"event": "tcp", "local": local, "peer": peer}));
    }
}

fn udp_echo(sock: &Socket) -> io::Result<()> {
    let port = sock.local_addr()?.port();
    let mut buf = vec![0u8; 65536];
    loop {
        let (_, peer, local) = sock.recv_pktinfo(&mut buf)?;
        let Some(local_ip) = local else { continue };
        let local = SocketAddr::new(local_ip, port);
        let _ = sock.send_from(format_report(local, peer).as_bytes(), &peer, local_ip);
        event(serde_json::json!({"event": "udp", "local": local, "peer": peer}));
    }
}

fn sctp_echo(sock: &Socket, ports: &BTreeSet<u16>) -> io::Result<()> {
    let mut buf = vec![0u8; 65536];
    loop {
        let (n, peer, local) = sock.recv_pktinfo(&mut buf)?;
        let Some(local_ip) = local else { continue };
        // IPv4 raw sockets deliver the IP header too.
        let start = if peer.is_ipv4() {
            usize::from(buf[0] & 0x0f) * 4
        } else {
            0
        };
        let Some(pkt) = Packet::parse(&buf[start.min(n)..n]) else {
            continue;
        };
        let Some(tag) = pkt.init_tag() else { continue };
        let local = SocketAddr::new(local_ip, pkt.dst_port);
        let peer = SocketAddr::new(peer.ip(), pkt.src_port);
        if !pkt.checksum_ok {
            event(serde_json::json!({"event": "sctp_bad_checksum", "local": local, "peer": peer}));
            continue;
        }
        let known = ports.contains(&pkt.dst_port);
        let report = format_report(local, peer);
        let reply = sctp::build_abort(
            pkt.dst_port,
            pkt.src_port,
            tag,
            known.then_some(report.as_bytes()),
        );
        let _ = sock.send_from(&reply, &SocketAddr::new(peer.ip(), 0), local_ip);
        let kind = if known { "sctp" } else { "sctp_refused" };
        event(serde_json::json!({"event": kind, "local": local, "peer": peer}));
    }
}

struct ProbeOpts {
    proto: Proto,
    dst: SocketAddr,
    count: usize,
    src: Option<IpAddr>,
    timeout: Duration,
    parallel: usize,
    sport: Option<u16>,
    no_udp_checksum: bool,
}

fn probe(opts: &Opts) -> Result<()> {
    let sport: Option<u16> = opts
        .get("sport")
        .map(str::parse)
        .transpose()
        .context("--sport")?;
    let p = ProbeOpts {
        proto: opts.parsed("proto", None)?,
        dst: opts.parsed("dst", None)?,
        count: opts.parsed("count", Some(1))?,
        src: opts
            .get("src")
            .map(str::parse)
            .transpose()
            .context("--src")?,
        timeout: Duration::from_millis(opts.parsed("timeout-ms", Some(1000))?),
        // One source port: one attempt at a time.
        parallel: match sport {
            Some(_) => 1,
            None => opts.parsed::<usize>("parallel", Some(1))?.max(1),
        },
        sport,
        no_udp_checksum: opts.flag("no-udp-checksum"),
    };
    let next = AtomicUsize::new(0);
    let out = Mutex::new(io::BufWriter::new(io::stdout()));
    std::thread::scope(|s| {
        for _ in 0..p.parallel.min(p.count) {
            s.spawn(|| {
                while next.fetch_add(1, Ordering::Relaxed) < p.count {
                    let attempt = match p.proto {
                        Proto::Tcp => tcp_attempt(&p),
                        Proto::Udp => udp_attempt(&p),
                        Proto::Sctp => sctp_attempt(&p),
                    }
                    .unwrap_or_else(|e| Attempt::Error {
                        error: error_name(&e),
                    });
                    let line = serde_json::to_string(&attempt).expect("serializable");
                    let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = writeln!(out, "{line}");
                }
            });
        }
    });
    out.into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .flush()?;
    Ok(())
}

fn answered(src: SocketAddr, report: &[u8]) -> Attempt {
    let text = String::from_utf8_lossy(report);
    match parse_report(&text) {
        Some((local, peer)) => Attempt::Answered { src, local, peer },
        None => Attempt::Error {
            error: format!("unexpected answer {text:?}"),
        },
    }
}

fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

/// Queue ICMP errors on the socket's error queue (`recv_error`).
fn set_recverr(s: &Socket, dst: SocketAddr) -> io::Result<()> {
    if dst.is_ipv6() {
        s.set_int(libc::IPPROTO_IPV6, libc::IPV6_RECVERR, 1)
    } else {
        s.set_int(libc::IPPROTO_IP, libc::IP_RECVERR, 1)
    }
}

/// The ICMP error in an error queue entry as an attempt.
fn icmp_attempt(err: &sock::QueuedError) -> Attempt {
    if err.is_port_unreachable() {
        Attempt::Refused
    } else {
        Attempt::Error {
            error: format!(
                "ICMP type {} code {} ({})",
                err.icmp_type,
                err.icmp_code,
                error_name(&io::Error::from_raw_os_error(err.errno))
            ),
        }
    }
}

/// A non-blocking connect; `None` once connected, else how the attempt ended.
///
/// The ICMP error of an nftables `reject` can come back while `connect()` itself still
/// runs (veth delivery is synchronous): TCP then only records a "soft" error and
/// retransmits the SYN a second later. `IP_RECVERR` queues the ICMP error regardless, so
/// we see it at once.
fn tcp_connect(s: &Socket, p: &ProbeOpts) -> io::Result<Option<Attempt>> {
    set_recverr(s, p.dst)?;
    s.set_nonblocking(true)?;
    match s.connect(&p.dst) {
        Ok(()) => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            return Ok(Some(Attempt::Refused));
        }
        Err(e) => return Err(e),
    }
    let deadline = Instant::now() + p.timeout;
    loop {
        let Some(left) = remaining(deadline) else {
            return Ok(Some(Attempt::Timeout));
        };
        let revents = s.poll(libc::POLLOUT, Some(left))?;
        if revents == 0 {
            continue;
        }
        if let Some(err) = s.recv_error()? {
            return Ok(Some(icmp_attempt(&err)));
        }
        match s.take_error()? {
            0 if revents & libc::POLLOUT != 0 => return Ok(None),
            0 => {}
            libc::ECONNREFUSED => return Ok(Some(Attempt::Refused)),
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

/// Binds the probe's source address and port, if it has any.
fn bind_source(s: &Socket, p: &ProbeOpts) -> io::Result<()> {
    let port = p.sport.unwrap_or(0);
    let ip = match p.src {
        Some(ip) => ip,
        None if port == 0 => return Ok(()),
        None if p.dst.is_ipv6() => Ipv6Addr::UNSPECIFIED.into(),
        None => Ipv4Addr::UNSPECIFIED.into(),
    };
    if port != 0 {
        s.set_int(libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    }
    s.bind(&SocketAddr::new(ip, port))
}

fn tcp_attempt(p: &ProbeOpts) -> io::Result<Attempt> {
    let s = Socket::new(family(p.dst.ip()), libc::SOCK_STREAM, 0)?;
    bind_source(&s, p)?;
    if let Some(failed) = tcp_connect(&s, p)? {
        return Ok(failed);
    }
    let src = s.local_addr()?;
    // Connected: the echo writes its report and closes.
    let deadline = Instant::now() + p.timeout;
    let mut report = Vec::new();
    let mut chunk = [0u8; 512];
    while !report.contains(&b'\n') {
        let Some(left) = remaining(deadline) else {
            return Ok(Attempt::Error {
                error: "connected, but no report in time".into(),
            });
        };
        if s.poll(libc::POLLIN, Some(left))? == 0 {
            continue;
        }
        match s.recv(&mut chunk) {
            Ok(0) => break,
            Ok(n) => report.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(answered(src, &report))
}

fn udp_attempt(p: &ProbeOpts) -> io::Result<Attempt> {
    let s = Socket::new(family(p.dst.ip()), libc::SOCK_DGRAM, 0)?;
    bind_source(&s, p)?;
    // Every ICMP error (also "unreachable", which UDP otherwise ignores) ends the attempt,
    // so a missing route does not pass for a drop.
    set_recverr(&s, p.dst)?;
    if p.no_udp_checksum {
        s.set_int(libc::SOL_SOCKET, libc::SO_NO_CHECK, 1)?;
    }
    s.connect(&p.dst)?;
    let src = s.local_addr()?;
    s.send(b"nettest probe")?;
    let start = Instant::now();
    let deadline = start + p.timeout;
    // Like any UDP client, send once more half-way: on a loaded host a datagram (or the ICMP
    // error answering it) is occasionally lost, which must not read as a drop.
    let mut resend_at = Some(start + p.timeout / 2);
    let mut buf = [0u8; 2048];
    loop {
        let wait_until = resend_at.unwrap_or(deadline);
        let Some(left) = remaining(wait_until) else {
            if resend_at.take().is_some() {
                s.send(b"nettest probe")?;
                continue;
            }
            return Ok(Attempt::Timeout);
        };
        if s.poll(libc::POLLIN, Some(left))? == 0 {
            continue;
        }
        // A connected UDP socket reports an ICMP port unreachable as ECONNREFUSED.
        if let Some(err) = s.recv_error()? {
            return Ok(icmp_attempt(&err));
        }
        match s.recv(&mut buf) {
            Ok(n) => return Ok(answered(src, &buf[..n])),
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => return Ok(Attempt::Refused),
            Err(e) => return Err(e),
        }
    }
}

fn sctp_attempt(p: &ProbeOpts) -> io::Result<Attempt> {
    let v6 = p.dst.is_ipv6();
    let s = Socket::new(family(p.dst.ip()), libc::SOCK_RAW, libc::IPPROTO_SCTP)?;
    set_recverr(&s, p.dst)?;
    let src_ip = match p.src {
        Some(ip) => {
            s.bind(&SocketAddr::new(ip, 0))?;
            ip
        }
        None => sock::route_source(p.dst.ip())?,
    };
    let sport = 20000 + (sock::random_u32() % 40000) as u16;
    let tag = sock::random_u32() | 1;
    let init = sctp::build_init(sport, p.dst.port(), tag, sock::random_u32());
    s.send_to(&init, &SocketAddr::new(p.dst.ip(), 0))?;
    let src = SocketAddr::new(src_ip, sport);
    // Raw sockets see every SCTP packet and every ICMP error about SCTP in the namespace:
    // only ours (ports and tags) count.
    let ours_in_error = |payload: &[u8]| {
        payload.len() >= 8
            && payload[0..2] == sport.to_be_bytes()
            && payload[2..4] == p.dst.port().to_be_bytes()
            && (payload.len() < 20 || payload[16..20] == tag.to_be_bytes())
    };
    let deadline = Instant::now() + p.timeout;
    let mut buf = vec![0u8; 65536];
    loop {
        let Some(left) = remaining(deadline) else {
            return Ok(Attempt::Timeout);
        };
        let revents = s.poll(libc::POLLIN, Some(left))?;
        if revents & libc::POLLERR != 0 {
            let mut any = false;
            while let Some(err) = s.recv_error()? {
                any = true;
                if ours_in_error(&err.payload) {
                    return Ok(icmp_attempt(&err));
                }
            }
            if !any {
                s.take_error()?;
            }
        }
        if revents & libc::POLLIN == 0 {
            continue;
        }
        let n = match s.recv(&mut buf) {
            Ok(n) => n,
            Err(_) => continue, // a pending ICMP error, possibly another attempt's
        };
        let start = if v6 {
            0
        } else {
            usize::from(buf[0] & 0x0f) * 4
        };
        let Some(pkt) = Packet::parse(&buf[start.min(n)..n]) else {
            continue;
        };
        if pkt.src_port != p.dst.port() || pkt.dst_port != sport || pkt.vtag != tag {
            continue;
        }
        if !pkt.checksum_ok {
            return Ok(Attempt::Error {
                error: "SCTP reply with a bad checksum".into(),
            });
        }
        if let Some(reason) = pkt.abort_reason() {
            return Ok(if reason.is_empty() {
                Attempt::Refused
            } else {
                answered(src, &reason)
            });
        }
        if pkt
            .chunks
            .first()
            .is_some_and(|c| c.kind == sctp::CHUNK_INIT_ACK)
        {
            return Ok(Attempt::Error {
                error: "INIT-ACK: a real SCTP stack answered".into(),
            });
        }
    }
}
