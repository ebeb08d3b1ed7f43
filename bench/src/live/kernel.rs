//! The kernel's side of the live benchmark, inside the agent's namespace: when the ruleset
//! generation moves (a commit), a process that listens to nf_tables notifications as `nft
//! monitor` does, and the endpoint elements the notifications announce.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use netlink_sys::Socket;
use nftproxy::nftables::Nftables;

use crate::netns::Netns;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFPROTO_IPV4: u8 = 2;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;

/// A thread that stops (and is joined) on drop.
struct Stoppable {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Stoppable {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Spawns `body` on a thread that has entered `ns`; `body` returns when the flag is set.
fn spawn_in(
    ns: &Netns,
    name: &str,
    body: impl FnOnce(&AtomicBool) + Send + 'static,
) -> Result<Stoppable> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let file = std::fs::File::open(format!("/run/netns/{}", ns.name()))?;
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            // SAFETY: setns(2) on an open namespace file; affects only this thread.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                eprintln!("{}: setns: {}", file!(), io::Error::last_os_error());
                return;
            }
            drop(file);
            body(&flag);
        })?;
    Ok(Stoppable {
        stop,
        thread: Some(thread),
    })
}

/// Polls the ruleset generation every millisecond (a `GETGEN` request, which needs no
/// subscription and so costs the commits nothing) and remembers when it last moved.
pub struct Generations {
    _thread: Stoppable,
    /// Nanoseconds after `origin` of the last change seen, 0 before any.
    last_change: Arc<AtomicU64>,
    changes: Arc<AtomicU64>,
    origin: Instant,
}

impl Generations {
    pub fn start(ns: &Netns) -> Result<Generations> {
        let origin = Instant::now();
        let last_change = Arc::new(AtomicU64::new(0));
        let changes = Arc::new(AtomicU64::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let (last, count) = (last_change.clone(), changes.clone());
        let thread = spawn_in(ns, "generations", move |stop| {
            let mut nft = match Nftables::open() {
                Ok(n) => n,
                Err(e) => return drop(tx.send(Err(e.to_string()))),
            };
            let mut seen = nft.generation().ok();
            let _ = tx.send(Ok(()));
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
                let Ok(g) = nft.generation() else { continue };
                if Some(g) != seen {
                    seen = Some(g);
                    last.store(origin.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        })?;
        rx.recv()
            .context("generation poller died")?
            .map_err(anyhow::Error::msg)
            .context("reading the ruleset generation")?;
        Ok(Generations {
            _thread: thread,
            last_change,
            changes,
            origin,
        })
    }

    /// When the generation last moved, if it did.
    pub fn last_change(&self) -> Option<Instant> {
        let ns = self.last_change.load(Ordering::Relaxed);
        (ns > 0).then(|| self.origin + Duration::from_nanos(ns))
    }

    /// Commits seen so far.
    pub fn commits(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }
}

/// Receives notifications until `stop`, handing each datagram to `f`; counts the overflows
/// (`ENOBUFS`: the kernel dropped some).
fn receive(
    sock: &Socket,
    stop: &AtomicBool,
    overflows: &AtomicU64,
    mut f: impl FnMut(&[u8], Instant),
) {
    let mut buf = vec![0u8; 1 << 17];
    // A receive that times out now and then sees the stop flag even when nothing is
    // committed any more.
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: 100_000,
    };
    // SAFETY: setsockopt(2) on an open socket with a timeval of the size given.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    while !stop.load(Ordering::Relaxed) {
        match sock.recv(&mut &mut buf[..], 0) {
            Ok(n) => f(&buf[..n.min(buf.len())], Instant::now()),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                overflows.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
    }
}

/// Another process's view of nf_tables, as `nft monitor` has it: subscribed to every
/// notification in the namespace, reading them all (and decoding nothing). While it listens,
/// the kernel builds a notification for every object a transaction touches.
pub struct Listener {
    _thread: Stoppable,
    pub bytes: Arc<AtomicU64>,
    pub overflows: Arc<AtomicU64>,
}

impl Listener {
    pub fn start(ns: &Netns) -> Result<Listener> {
        let bytes = Arc::new(AtomicU64::new(0));
        let overflows = Arc::new(AtomicU64::new(0));
        let (b, o) = (bytes.clone(), overflows.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = spawn_in(ns, "listener", move |stop| {
            // libmnl's default receive buffer, as `nft monitor` uses.
            let sock = match nftproxy::nftables::monitor::subscribe(208 * 1024) {
                Ok(s) => s,
                Err(e) => return drop(tx.send(Err(e))),
            };
            let _ = tx.send(Ok(()));
            receive(&sock, stop, &o, |d, _| {
                b.fetch_add(d.len() as u64, Ordering::Relaxed);
            });
        })?;
        rx.recv().context("listener died")??;
        Ok(Listener {
            _thread: thread,
            bytes,
            overflows,
        })
    }
}

/// An endpoint element as a notification announced it: the first 4 bytes of its key (a
/// Service's address) and of its data (an endpoint's address), host order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Element {
    pub key: u32,
    pub data: u32,
}

/// Follows the elements added to table `nftproxy` (IPv4), handing them with the time they
/// arrived to `f`.
pub struct ElementWatch {
    _thread: Stoppable,
    pub overflows: Arc<AtomicU64>,
}

impl ElementWatch {
    pub fn start(
        ns: &Netns,
        f: impl FnMut(&[Element], Instant) + Send + 'static,
    ) -> Result<ElementWatch> {
        let overflows = Arc::new(AtomicU64::new(0));
        let o = overflows.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let f = Mutex::new(f);
        let thread = spawn_in(ns, "elements", move |stop| {
            let sock = match nftproxy::nftables::monitor::subscribe(32 << 20) {
                Ok(s) => s,
                Err(e) => return drop(tx.send(Err(e))),
            };
            let _ = tx.send(Ok(()));
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            let mut found = Vec::new();
            receive(&sock, stop, &o, |d, at| {
                found.clear();
                added_elements(d, dataplane::nft::ruleset::TABLE, &mut found);
                if !found.is_empty() {
                    f(&found, at);
                }
            });
        })?;
        rx.recv().context("element watch died")??;
        Ok(ElementWatch {
            _thread: thread,
            overflows,
        })
    }
}

/// Netlink attributes of `buf`: (type without flags, payload).
fn attributes(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, payload))
    })
}

fn nested(buf: &[u8], kind: u16) -> Option<&[u8]> {
    attributes(buf).find(|(k, _)| *k == kind).map(|(_, p)| p)
}

fn first_u32(value: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(value.get(..4)?.try_into().ok()?))
}

/// Appends to `out` the elements with a value that the `NEWSETELEM` notifications in
/// `datagram` add to IPv4 table `table`.
pub fn added_elements(datagram: &[u8], table: &str, out: &mut Vec<Element>) {
    let mut rest = datagram;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        if len < NLMSG_HDRLEN || len > rest.len() {
            return;
        }
        let msg = &rest[..len];
        rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        if kind != (NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWSETELEM)
            || msg.len() < NLMSG_HDRLEN + NFGENMSG_LEN
            || msg[NLMSG_HDRLEN] != NFPROTO_IPV4
        {
            continue;
        }
        let attrs = &msg[NLMSG_HDRLEN + NFGENMSG_LEN..];
        let named = nested(attrs, NFTA_SET_ELEM_LIST_TABLE)
            .is_some_and(|t| t.split(|b| *b == 0).next() == Some(table.as_bytes()));
        let Some(elements) = nested(attrs, NFTA_SET_ELEM_LIST_ELEMENTS).filter(|_| named) else {
            continue;
        };
        for (k, elem) in attributes(elements) {
            if k != NFTA_LIST_ELEM {
                continue;
            }
            let value = |kind| nested(nested(elem, kind)?, NFTA_DATA_VALUE).and_then(first_u32);
            if let (Some(key), Some(data)) = (value(NFTA_SET_ELEM_KEY), value(NFTA_SET_ELEM_DATA)) {
                out.push(Element { key, data });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = ((4 + payload.len()) as u16).to_ne_bytes().to_vec();
        v.extend(kind.to_ne_bytes());
        v.extend(payload);
        v.resize(v.len().next_multiple_of(4), 0);
        v
    }

    fn message(family: u8, table: &str, elems: &[(&[u8], Option<&[u8]>)]) -> Vec<u8> {
        let mut list = Vec::new();
        for (key, data) in elems {
            let mut e = attr(NFTA_SET_ELEM_KEY | 0x8000, &attr(NFTA_DATA_VALUE, key));
            if let Some(d) = data {
                e.extend(attr(NFTA_SET_ELEM_DATA | 0x8000, &attr(NFTA_DATA_VALUE, d)));
            }
            list.extend(attr(NFTA_LIST_ELEM | 0x8000, &e));
        }
        let mut body = vec![family, 0, 0, 0];
        body.extend(attr(
            NFTA_SET_ELEM_LIST_TABLE,
            format!("{table}\0").as_bytes(),
        ));
        body.extend(attr(2, b"cluster-endpoints-5\0"));
        body.extend(attr(NFTA_SET_ELEM_LIST_ELEMENTS | 0x8000, &list));
        let mut msg = ((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes().to_vec();
        msg.extend((NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWSETELEM).to_ne_bytes());
        msg.extend([0u8; 10]);
        msg.extend(body);
        msg
    }

    #[test]
    fn endpoint_elements_are_found() {
        let key = [172, 16, 0, 12, 6, 0, 0, 0, 0, 80, 0, 0, 0, 0, 0, 3];
        let data = [10, 64, 1, 2, 0x1f, 0x90, 0, 0];
        let mut d = message(
            NFPROTO_IPV4,
            "nftproxy",
            &[(&key, Some(&data)), (&key, None)],
        );
        d.extend(message(10, "nftproxy", &[(&key, Some(&data))]));
        d.extend(message(NFPROTO_IPV4, "other", &[(&key, Some(&data))]));
        let mut out = Vec::new();
        added_elements(&d, "nftproxy", &mut out);
        assert_eq!(
            out,
            vec![Element {
                key: u32::from_be_bytes([172, 16, 0, 12]),
                data: u32::from_be_bytes([10, 64, 1, 2]),
            }]
        );
        // Truncated input is not an error.
        for cut in 0..d.len() {
            added_elements(&d[..cut], "nftproxy", &mut Vec::new());
        }
    }
}
