//! One connection budget for every HTTP listener of the process: `/metrics`, `/healthz` and
//! all the per-Service health-check node ports draw their connections from it, so flooding a
//! few of them cannot hold more connections (and memory) than the budget allows in total.
//!
//! Admission, at accept time:
//! * a source (an IPv4 address, or an IPv6 /64, which one host easily has) holds at most
//!   `max_per_source` connections: at the cap, that source's oldest idle connection is closed
//!   to make room, so a flooding source only ever pushes out its own connections;
//! * the process holds at most `max_connections`: when full, the oldest idle connection of
//!   anyone is closed. A connection is idle unless a request of it is being answered; a probe
//!   answered within a millisecond of its connect is never the oldest one.
//!
//! When every connection in question is busy answering a request, the new one is closed
//! instead. Either way a normal probe from a source that is not flooding gets in at once.
//!
//! A connection costs about 1.5 KiB until it sends something, and about 17 KiB from then on
//! (hyper's smallest read and write buffers). So a second, smaller cap counts connections
//! that have sent bytes (`max_active`): when it is reached, the oldest of them that is not
//! being answered (a half-sent request, an idle keep-alive connection) is closed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use tokio::sync::Notify;

/// Connections all HTTP listeners of the process hold at most. Load balancers, kubelets and
/// Prometheus need a few connections each, and only for milliseconds.
pub const MAX_CONNECTIONS: usize = 2048;
/// Connections one source (IPv4 address, IPv6 /64) holds at most.
pub const MAX_PER_SOURCE: usize = 128;
/// Connections that have sent bytes (and so hold HTTP buffers) at most: with the idle ones,
/// the listeners' connections take at most about 12 MiB.
pub const MAX_ACTIVE: usize = 512;

/// Where a connection comes from, for the per-source cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    V4(Ipv4Addr),
    /// The /64 prefix.
    V6(u64),
}

impl Source {
    pub fn of(ip: IpAddr) -> Source {
        // A dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d.
        match ip.to_canonical() {
            IpAddr::V4(a) => Source::V4(a),
            IpAddr::V6(a) => Source::V6((u128::from(a) >> 64) as u64),
        }
    }
}

/// Why a connection was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The source is at its cap and all its connections are answering requests.
    Source,
    /// The budget is spent and all connections are answering requests.
    Full,
    /// As many connections as allowed have sent bytes, and all are answering requests.
    Active,
}

/// Counts since the start, for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections open now.
    pub open: usize,
    /// Of those, connections that have sent bytes.
    pub active: usize,
    /// Idle connections closed to make room.
    pub evicted: u64,
    /// New connections closed at once.
    pub refused: u64,
}

struct Entry {
    source: Source,
    /// Requests being answered.
    busy: u32,
    evict: Arc<Notify>,
}

/// Why a connection was closed to make room.
#[derive(Clone, Copy, Debug)]
enum Room {
    Source,
    Total,
    Active,
}

#[derive(Default)]
struct Ledger {
    next_id: u64,
    /// Ids grow with time, so this is oldest first.
    conns: BTreeMap<u64, Entry>,
    by_source: HashMap<Source, BTreeSet<u64>>,
    /// Connections that have sent bytes, oldest first.
    active: BTreeSet<u64>,
    evicted: u64,
    refused: u64,
}

impl Ledger {
    fn oldest_idle<'a>(&self, mut ids: impl Iterator<Item = &'a u64>) -> Option<u64> {
        ids.find(|id| self.conns.get(id).is_some_and(|e| e.busy == 0))
            .copied()
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.conns.remove(&id)?;
        self.active.remove(&id);
        if let Some(ids) = self.by_source.get_mut(&entry.source) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_source.remove(&entry.source);
            }
        }
        Some(entry)
    }

    fn refused(&mut self, source: &Source, why: Refused) {
        self.refused += 1;
        if self.refused.is_power_of_two() {
            tracing::warn!(
                ?source,
                reason = ?why,
                refused = self.refused,
                open = self.conns.len(),
                "HTTP connection budget spent on busy connections: closing new ones"
            );
        }
    }

    fn evict(&mut self, id: u64, why: Room) {
        if let Some(entry) = self.remove(id) {
            self.evicted += 1;
            if self.evicted.is_power_of_two() {
                tracing::warn!(
                    evicted = self.evicted,
                    open = self.conns.len(),
                    active = self.active.len(),
                    limit = ?why,
                    "HTTP connection budget reached: closing the oldest idle connections"
                );
            }
            // A stored permit: the connection ends even if it is not waiting yet.
            entry.evict.notify_one();
        }
    }
}

/// The connection budget (see the module documentation).
pub struct Budget {
    max_connections: usize,
    max_per_source: usize,
    max_active: usize,
    ledger: Mutex<Ledger>,
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budget")
            .field("max_connections", &self.max_connections)
            .field("max_per_source", &self.max_per_source)
            .field("max_active", &self.max_active)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Budget {
    pub fn new(max_connections: usize, max_per_source: usize, max_active: usize) -> Arc<Budget> {
        Arc::new(Budget {
            max_connections: max_connections.max(1),
            max_per_source: max_per_source.clamp(1, max_connections.max(1)),
            max_active: max_active.clamp(1, max_connections.max(1)),
            ledger: Mutex::new(Ledger::default()),
        })
    }

    /// The process's budget, shared by every listener.
    pub fn shared() -> Arc<Budget> {
        static SHARED: OnceLock<Arc<Budget>> = OnceLock::new();
        SHARED
            .get_or_init(|| Budget::new(MAX_CONNECTIONS, MAX_PER_SOURCE, MAX_ACTIVE))
            .clone()
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn stats(&self) -> Stats {
        let l = self.lock();
        Stats {
            open: l.conns.len(),
            active: l.active.len(),
            evicted: l.evicted,
            refused: l.refused,
        }
    }

    /// Admits a connection from `peer`, closing an idle one to make room if needed.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Admitted, Refused> {
        let source = Source::of(peer);
        let mut l = self.lock();
        let held = l.by_source.get(&source).map_or(0, BTreeSet::len);
        if held >= self.max_per_source {
            let victim = l.oldest_idle(l.by_source.get(&source).into_iter().flatten());
            match victim {
                Some(id) => l.evict(id, Room::Source),
                None => {
                    l.refused(&source, Refused::Source);
                    return Err(Refused::Source);
                }
            }
        }
        if l.conns.len() >= self.max_connections {
            match l.oldest_idle(l.conns.keys()) {
                Some(id) => l.evict(id, Room::Total),
                None => {
                    l.refused(&source, Refused::Full);
                    return Err(Refused::Full);
                }
            }
        }
        let id = l.next_id;
        l.next_id += 1;
        let evict = Arc::new(Notify::new());
        l.conns.insert(
            id,
            Entry {
                source,
                busy: 0,
                evict: evict.clone(),
            },
        );
        l.by_source.entry(source).or_default().insert(id);
        Ok(Admitted {
            budget: self.clone(),
            id,
            evict,
        })
    }

    /// Counts connection `id` as having sent bytes, closing the oldest such connection not
    /// being answered if [`MAX_ACTIVE`] are. False if `id` was closed meanwhile or all of them
    /// are being answered: then `id` should close.
    fn activate(&self, id: u64) -> bool {
        let mut l = self.lock();
        if !l.conns.contains_key(&id) {
            return false;
        }
        if l.active.contains(&id) {
            return true;
        }
        if l.active.len() >= self.max_active {
            match l.oldest_idle(l.active.iter()) {
                Some(victim) => l.evict(victim, Room::Active),
                None => {
                    let source = l.conns[&id].source;
                    l.remove(id);
                    l.refused(&source, Refused::Active);
                    return false;
                }
            }
        }
        l.active.insert(id);
        true
    }

    fn set_busy(&self, id: u64, busy: bool) {
        if let Some(e) = self.lock().conns.get_mut(&id) {
            if busy {
                e.busy += 1;
            } else {
                e.busy = e.busy.saturating_sub(1);
            }
        }
    }
}

/// An admitted connection's place in the budget, given back on drop.
pub struct Admitted {
    budget: Arc<Budget>,
    id: u64,
    evict: Arc<Notify>,
}

impl Admitted {
    /// Completes when the budget closes this connection to make room for a newer one.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }

    /// A number in [0, 1) that differs from connection to connection (to spread timeouts).
    pub fn spread(&self) -> f64 {
        let h = self.id.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The connection has sent bytes (see [`Budget`]); false if it must close instead.
    pub fn activate(&self) -> bool {
        self.budget.activate(self.id)
    }

    /// Marks the connection busy (not to be closed for room) until the guard is dropped.
    pub fn busy(&self) -> Busy {
        self.budget.set_busy(self.id, true);
        Busy {
            budget: self.budget.clone(),
            id: self.id,
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.budget.lock().remove(self.id);
    }
}

/// See [`Admitted::busy`].
pub struct Busy {
    budget: Arc<Budget>,
    id: u64,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.budget.set_busy(self.id, false);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn evicted(a: &Admitted) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(1), a.evicted())
                .await
                .is_ok()
        })
    }

    #[test]
    fn sources_are_addresses_and_ipv6_prefixes() {
        assert_eq!(
            Source::of(ip("::ffff:10.0.0.1")),
            Source::of(ip("10.0.0.1"))
        );
        assert_ne!(Source::of(ip("10.0.0.1")), Source::of(ip("10.0.0.2")));
        assert_eq!(
            Source::of(ip("2001:db8:1:2::1")),
            Source::of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            Source::of(ip("2001:db8:1:2::1")),
            Source::of(ip("2001:db8:1:3::1"))
        );
    }

    #[test]
    fn a_source_at_its_cap_loses_its_own_oldest_idle_connection() {
        let b = Budget::new(10, 3, 10);
        let other = b.admit(ip("10.0.0.9")).unwrap();
        let a: Vec<Admitted> = (0..3).map(|_| b.admit(ip("10.0.0.1")).unwrap()).collect();
        let _busy = a[0].busy();
        let fourth = b.admit(ip("10.0.0.1")).unwrap();
        assert!(!evicted(&a[0]), "a busy connection was closed");
        assert!(evicted(&a[1]), "the oldest idle one stays");
        assert!(!evicted(&a[2]) && !evicted(&other) && !evicted(&fourth));
        assert_eq!(
            b.stats(),
            Stats {
                open: 4,
                active: 0,
                evicted: 1,
                refused: 0
            }
        );
        // All of the source's connections busy: the new one is refused.
        let _b2 = a[2].busy();
        let _b4 = fourth.busy();
        assert_eq!(b.admit(ip("10.0.0.1")).err(), Some(Refused::Source));
        assert!(b.admit(ip("10.0.0.2")).is_ok());
    }

    #[test]
    fn a_full_budget_closes_the_oldest_idle_connection_of_anyone() {
        let b = Budget::new(4, 4, 4);
        let first = b.admit(ip("10.0.0.1")).unwrap();
        let second = b.admit(ip("10.0.0.2")).unwrap();
        let _busy = first.busy();
        let rest: Vec<Admitted> = (3..5)
            .map(|i| b.admit(ip(&format!("10.0.0.{i}"))).unwrap())
            .collect();
        let probe = b.admit(ip("10.0.0.200")).unwrap();
        assert!(evicted(&second) && !evicted(&first));
        assert!(!evicted(&probe) && rest.iter().all(|a| !evicted(a)));
        assert_eq!(b.stats().open, 4);
        // Dropped connections give their place back; an evicted one's drop is harmless.
        drop(second);
        drop(rest);
        assert_eq!(b.stats().open, 2);
        let _busy_probe = probe.busy();
        let c = b.admit(ip("10.0.0.7")).unwrap();
        let d = b.admit(ip("10.0.0.8")).unwrap();
        let e = b.admit(ip("10.0.0.9")).unwrap();
        assert!(evicted(&c) && !evicted(&d));
        // Full of busy connections: refused.
        let (_bd, _be) = (d.busy(), e.busy());
        assert_eq!(b.admit(ip("10.0.0.10")).err(), Some(Refused::Full));
        assert_eq!(b.stats().refused, 1);
    }

    #[test]
    fn connections_that_send_make_room_among_themselves() {
        let b = Budget::new(10, 10, 2);
        let idle = b.admit(ip("10.0.0.1")).unwrap();
        let (x, y, z) = (
            b.admit(ip("10.0.0.2")).unwrap(),
            b.admit(ip("10.0.0.3")).unwrap(),
            b.admit(ip("10.0.0.4")).unwrap(),
        );
        assert!(x.activate() && y.activate());
        assert!(x.activate(), "activating twice counts once");
        // A third one that sends: the oldest active one not being answered makes room.
        let _busy = x.busy();
        assert!(z.activate());
        assert!(evicted(&y) && !evicted(&x) && !evicted(&idle));
        assert_eq!(b.stats().active, 2);
        // All active ones busy: the newcomer closes.
        let _busy_z = z.busy();
        let w = b.admit(ip("10.0.0.5")).unwrap();
        assert!(!w.activate());
        assert_eq!(b.stats().refused, 1);
        assert_eq!(b.stats().open, 3);
        drop(x);
        assert_eq!(b.stats().active, 1);
    }
}
