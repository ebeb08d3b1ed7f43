//! What the nftables proxier needs of the kernel, as a small trait: read a family's table back,
//! commit transactions. [`Netlink`] is nf_tables itself; [`super::fake::FakeKernel`] is an
//! in-memory stand-in that refuses what the kernel refuses, for tests without root.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dataplane::nft::build::affinity::Entry;
use dataplane::nft::ruleset::Family;
use dataplane::nft::state::TableState;
use dataplane::nft::transaction::Transaction;

use super::monitor::Quieter;
use super::{ApplyStats, NftError, Nftables};

/// The kernel interface of one family's nftables proxier.
pub trait NftKernel: Send {
    /// Reads back table `nftproxy` of `family`; `Ok(None)` if the table does not exist.
    fn read_table(&mut self, family: Family) -> Result<Option<TableState>, NftError>;

    /// Commits one transaction atomically. An empty one sends nothing.
    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NftError>;

    /// Commits `txs` one after the other, stopping at the first that fails; each one that
    /// committed is handed to `committed`.
    fn apply_all(
        &mut self,
        txs: Vec<Transaction>,
        committed: &mut dyn FnMut(&Transaction),
    ) -> Result<ApplyStats, NftError>;

    /// The entries of the session-affinity map of `family`'s table. A kernel that carries no
    /// traffic (the fake) has none.
    fn affinity_entries(&mut self, _family: Family) -> Result<Vec<Entry>, NftError> {
        Ok(Vec::new())
    }

    /// Deletes those of `stale` that are still in the session-affinity map; returns how many.
    fn delete_affinity_entries(
        &mut self,
        _family: Family,
        _stale: &[Entry],
    ) -> Result<usize, NftError> {
        Ok(0)
    }

    /// Whether another process in the namespace listens to nf_tables notifications (see
    /// `dataplane::nft::cold`). A kernel that cannot tell (the fake) says no.
    fn others_listen(&mut self) -> bool {
        false
    }

    /// Runs `commit` with the drift monitor's notifications paused, when there is a monitor
    /// (see [`Quieter`]).
    fn quietly<T>(&mut self, commit: impl FnOnce(&mut Self) -> T) -> T
    where
        Self: Sized,
    {
        commit(self)
    }

    /// Lets [`NftKernel::quietly`] pause the drift monitor's notifications.
    fn set_quieter(&mut self, _quieter: Arc<Quieter>) {}

    /// The netlink port id of the connection, which nf_tables names as the cause of our own
    /// changes; `None` for a kernel that is not reached over netlink.
    fn portid(&self) -> Option<u32> {
        None
    }
}

/// nf_tables over one netlink connection, opened in the calling thread's namespace. Clones
/// share the connection: both families' proxiers commit through it, so that the drift monitor
/// knows our own changes by one port id and the quieter counts all our commits.
#[derive(Clone)]
pub struct Netlink {
    inner: Arc<Mutex<Connection>>,
}

struct Connection {
    nft: Nftables,
    quieter: Option<Arc<Quieter>>,
}

impl Netlink {
    pub fn open() -> Result<Netlink, NftError> {
        Ok(Netlink {
            inner: Arc::new(Mutex::new(Connection {
                nft: Nftables::open()?,
                quieter: None,
            })),
        })
    }

    /// Runs `f` on the connection itself (table deletion, generation reads).
    pub fn with<T>(&self, f: impl FnOnce(&mut Nftables) -> T) -> T {
        f(&mut self.lock().nft)
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // The connection holds no state a panic could leave half-updated.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl NftKernel for Netlink {
    fn read_table(&mut self, family: Family) -> Result<Option<TableState>, NftError> {
        self.lock().nft.read_table(family)
    }

    fn apply(&mut self, tx: &Transaction) -> Result<ApplyStats, NftError> {
        self.lock().nft.apply(tx)
    }

    fn apply_all(
        &mut self,
        txs: Vec<Transaction>,
        committed: &mut dyn FnMut(&Transaction),
    ) -> Result<ApplyStats, NftError> {
        self.lock().nft.apply_all(txs, committed)
    }

    fn affinity_entries(&mut self, family: Family) -> Result<Vec<Entry>, NftError> {
        self.lock().nft.affinity_entries(family)
    }

    fn delete_affinity_entries(
        &mut self,
        family: Family,
        stale: &[Entry],
    ) -> Result<usize, NftError> {
        self.lock().nft.delete_affinity_entries(family, stale)
    }

    fn others_listen(&mut self) -> bool {
        super::listeners::others_listen()
    }

    fn quietly<T>(&mut self, commit: impl FnOnce(&mut Self) -> T) -> T {
        let Some(q) = self.lock().quieter.clone() else {
            return commit(self);
        };
        let paused = q.pause(&mut self.lock().nft);
        let out = commit(self);
        if let Some(paused) = paused {
            q.resume(&mut self.lock().nft, paused);
        }
        out
    }

    fn set_quieter(&mut self, quieter: Arc<Quieter>) {
        self.lock().quieter = Some(quieter);
    }

    fn portid(&self) -> Option<u32> {
        Some(self.lock().nft.portid())
    }
}
